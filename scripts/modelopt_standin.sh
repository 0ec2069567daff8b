# Sourced by the device scripts (scripts/gpu_tests.sh, scripts/real_width.sh) on a machine whose
# packages come from the packed site (scripts/device_site.sh), which leaves out nvidia-modelopt
# (17 MB, with pydantic and pulp). An installed glm5-bridge has it through megatron-bridge, whose
# 0.6.2 HF writer (AutoBridge.save_hf_pretrained) imports it only to ask whether the model is
# quantized. Where modelopt cannot be imported, a one-function stand-in answering "no" goes on
# PYTHONPATH (its own folder under /tmp, not the site); where it can, nothing changes.
if ! python3 -c "import modelopt" 2>/dev/null; then
    _standin=/tmp/modelopt_standin
    _q=$_standin/modelopt/torch/quantization
    mkdir -p "$_q"
    touch "$_standin/modelopt/__init__.py" "$_standin/modelopt/torch/__init__.py" "$_q/__init__.py"
    printf 'def is_quantized(model):\n    return False\n' > "$_q/utils.py"
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$_standin
    unset _standin _q
fi
