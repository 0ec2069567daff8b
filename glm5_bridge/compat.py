"""Workarounds for places where megatron-core 0.19 / megatron-bridge 0.6 hard-code CUDA or
Transformer Engine (TE). Everything of that kind lives here, one function per item, each with a
test in tests/test_compat.py that fails once upstream no longer needs it.

`install()` is idempotent and is called by `import glm5_bridge`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


# --- 1. megatron-bridge imports TE unconditionally ---------------------------------------------
# `megatron/bridge/peft/lora_layers.py` does `import transformer_engine.pytorch as te` at module
# level, so `import megatron.bridge` fails without TE. Its TE use is limited to isinstance checks
# and an optional fused path. A global fake TE module would make megatron-core believe TE is
# installed, so the stand-in is visible to that one module only, for the duration of its import.


class _AbsentTE(type):
    """Stand-in for any TE attribute: a class that nothing is an instance of."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentTE(name, (), {})


class _LoraLayersWithoutTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    target = "megatron.bridge.peft.lora_layers"
    # Imported first so that they never see the stand-in while lora_layers runs.
    dependencies = ("megatron.core.transformer.moe.moe_utils", "megatron.bridge.peft.adapter_wrapper",
                    "megatron.bridge.peft.lora_merge")

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            self._real_loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        for dep in self.dependencies:
            importlib.import_module(dep)
        te_pytorch = _AbsentTE("transformer_engine.pytorch", (), {})
        te = types.ModuleType("transformer_engine")
        te.pytorch = te_pytorch
        stand_ins = {"transformer_engine": te, "transformer_engine.pytorch": te_pytorch}
        sys.modules.update(stand_ins)
        try:
            self._real_loader.exec_module(module)
        finally:
            for key in stand_ins:
                sys.modules.pop(key, None)


def _import_bridge_without_te() -> None:
    if HAVE_TE or any(isinstance(f, _LoraLayersWithoutTE) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _LoraLayersWithoutTE())


# --- 2. megatron-bridge starts NCCL and seeds CUDA -------------------------------------------------
# `provide_distributed_model` / `initialize_model_parallel` call `torch.cuda.set_device`, start an
# NCCL process group and `model_parallel_cuda_manual_seed`; on a machine without a GPU each raises
# "Found no NVIDIA driver". Our provider (bridge.py) calls these two instead when CUDA is absent.


def init_cpu_process_group() -> None:
    """A gloo process group from the usual env vars (single process if none are set)."""
    import os

    import torch

    if torch.distributed.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by a launcher (torchrun, …)
        for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, default)
        torch.distributed.init_process_group("gloo")
        return
    # A lone process: a free port, passed directly rather than through os.environ so that
    # subprocesses (which inherit the environment) do not try to listen on the same port.
    from glm5_bridge.distributed import free_port

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def cpu_seed(seed: int) -> None:
    """Seed torch, and give megatron its no-op RNG tracker: the per-TP-rank CUDA RNG streams only
    serve dropout, and GLM-5 has none (hidden/attention dropout 0)."""
    import torch
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.manual_seed(seed)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


# --- 3. megatron-bridge builds the MTP spec with TE ---------------------------------------------
# `GPTModelProvider.provide()` calls the module function `gpt_provider.mtp_block_spec`, which
# always asks for TE modules. Providers that define `build_mtp_block_spec` (ours) get theirs.


def _provider_mtp_spec_hook() -> None:
    from megatron.bridge.models import gpt_provider

    original = gpt_provider.mtp_block_spec
    if getattr(original, "_glm5_hook", False):
        return

    def mtp_block_spec(config, vp_stage=None):
        if hasattr(config, "build_mtp_block_spec"):
            return config.build_mtp_block_spec(vp_stage=vp_stage)
        return original(config, vp_stage=vp_stage)

    mtp_block_spec._glm5_hook = True
    mtp_block_spec.__wrapped__ = original
    gpt_provider.mtp_block_spec = mtp_block_spec


# --- 4. megatron-core places buffers on `torch.cuda.current_device()` and synchronizes CUDA --------
# The MoE router's expert_bias and token counters, RotaryEmbedding's inv_freq (at init and again on
# first use), dist_checkpointing's flags and others are created with
# `device=torch.cuda.current_device()`, and dist_checkpointing calls `torch.cuda.synchronize()`;
# both raise without a GPU even when `use_cpu_initialization` is set. On a machine with no CUDA
# device the first answers "cpu" and the second has nothing to wait for; with a GPU nothing changes.


def _current_device_on_cpu_machines() -> None:
    import torch

    if torch.cuda.is_available() or getattr(torch.cuda.current_device, "_glm5_cpu", False):
        return

    def current_device():
        return "cpu"

    def synchronize(device=None):
        return None

    current_device._glm5_cpu = True
    torch.cuda.current_device = current_device
    torch.cuda.synchronize = synchronize


# --- 5. absorbed MLA accepts only TE's duplicated linear for the down-projections -----------------
# `AbsorbedMLASelfAttention.__init__` checks `linear_q_down_proj in [TELinear]` to pass
# `parallel_mode="duplicated"`; without TE that name is None and any other class is refused. Our
# `DuplicatedLinear` takes its place there (the spec uses TE's own TELinear when TE is installed).


def _absorbed_mla_duplicated_linear() -> None:
    if HAVE_TE:
        return
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    from glm5_bridge.model.layers import DuplicatedLinear

    absorbed_mla.TELinear = DuplicatedLinear


# --- 6. megatron-bridge's PEFT believes TE is installed when it is not ---------------------------
# `megatron/bridge/peft/utils.py` and `module_matcher.py` set their HAVE_TE* flags from
# `safe_import_from("megatron.core.extensions.transformer_engine", ...)`, which succeeds without TE
# because megatron-core defines those classes on a MagicMock. `get_adapter_attributes_from_linear`
# then runs `isinstance(m, TEColumnParallelLinear)` and raises TypeError for every linear, so no
# LoRA can be applied (and exclude_modules matching fails the same way). Without TE the flags are
# set to what they mean.


def _peft_te_flags() -> None:
    if HAVE_TE:
        return
    from megatron.bridge.peft import module_matcher, utils

    utils.HAVE_TE = False
    for module in (utils, module_matcher):
        for name in ("HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"):
            setattr(module, name, False)
    module_matcher.HAVE_TE = False


# --- 7. megatron-core copies the pipeline's duplicated embedding with `.cuda()` ------------------
# With pipeline parallelism and an MTP layer (or tied embeddings), the last stage keeps a copy of
# the word embeddings; `LanguageModule.setup_embeddings_and_output_layer` moves it with
# `weight.data.cuda()` before the all-reduce that initialises it from the first stage, which raises
# without a GPU. On a machine with no CUDA device, `.cuda()` leaves the tensor where it is for the
# duration of that one method; with a GPU nothing changes.


def _pipeline_embedding_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_glm5_cpu", False):
        return

    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        to_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = to_cuda

    setup_embeddings_and_output_layer._glm5_cpu = True
    setup_embeddings_and_output_layer.__wrapped__ = original
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


# --- 8. megatron-core's pipeline schedules count tokens in a `device="cuda"` tensor ----------------
# `forward_backward_no_pipelining` and both pipelined schedules start with
# `torch.zeros([], dtype=torch.int, device="cuda")`. On a machine with no CUDA device, the
# schedules module sees a `torch` whose `zeros` puts "cuda" tensors on the CPU (everything else is
# torch itself); other modules are untouched. With a GPU nothing changes.


class _TorchWithCpuZeros(types.ModuleType):
    def __init__(self, torch_module):
        super().__init__("torch")
        self._torch = torch_module

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def zeros(self, *args, device=None, **kwargs):
        if device == "cuda" or (isinstance(device, self._torch.device) and device.type == "cuda"):
            device = "cpu"
        return self._torch.zeros(*args, device=device, **kwargs)


def _pipeline_schedules_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _TorchWithCpuZeros):
        schedules.torch = _TorchWithCpuZeros(torch)


def install() -> None:
    _absorbed_mla_duplicated_linear()
    _current_device_on_cpu_machines()
    _import_bridge_without_te()
    _provider_mtp_spec_hook()
    _peft_te_flags()
    _pipeline_embedding_without_cuda()
    _pipeline_schedules_without_cuda()
