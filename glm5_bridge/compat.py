"""Workarounds for places where megatron-core 0.19 / megatron-bridge 0.6 hard-code CUDA or
Transformer Engine (TE). Everything of that kind lives here, one function per item, each with a
test in tests/test_compat.py that fails once upstream no longer needs it.

Nothing here runs at import. Each item is applied by an explicit call where it is needed, and as
narrowly as it can be:
- 1 (import megatron-bridge without TE): `megatron_bridge_without_te()`, around model/bridge.py's
  imports of megatron-bridge; the stand-in exists only while one upstream module is imported.
- 3 (MTP spec) and 5 (absorbed MLA's duplicated linear): context managers around our provider's
  `provide()` (model/bridge.py).
- 4, 6, 7, 8, 9: `enable_cpu_support()`, which the CLI, the trainers, the tests and our provider
  (when it builds a model on a machine without CUDA) call. Each installs only where it applies: 4,
  7, 8 and 9 on a machine without a CUDA device, 6 without TE. 4 is process-wide there (megatron
  asks `torch.cuda.current_device()` from over a hundred places, each of which can only raise
  without a GPU); 7 lasts one method call; 8 and 9 affect the named upstream modules only.
- 10 (CUDA type names): a context manager the trainer enters around building and stepping the
  optimizer.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from contextlib import contextmanager

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


@contextmanager
def megatron_bridge_without_te():
    """Import megatron-bridge inside this block (a no-op with TE installed)."""
    if HAVE_TE or "megatron.bridge.peft.lora_layers" in sys.modules:
        yield
        return
    finder = _LoraLayersWithoutTE()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


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
# always asks for TE modules. While our provider's `provide()` runs, that function returns the
# provider's own `build_mtp_block_spec`.


@contextmanager
def provider_mtp_spec(provider):
    from megatron.bridge.models import gpt_provider

    original = gpt_provider.mtp_block_spec

    def mtp_block_spec(config, vp_stage=None):
        if config is provider:
            return provider.build_mtp_block_spec(vp_stage=vp_stage)
        return original(config, vp_stage=vp_stage)

    gpt_provider.mtp_block_spec = mtp_block_spec
    try:
        yield
    finally:
        gpt_provider.mtp_block_spec = original


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
# `parallel_mode="duplicated"`; without TE that name is None and any other class is refused. While
# a model is built, our `DuplicatedLinear` (the class the caller passes) takes its place there (the
# spec uses TE's own TELinear when TE is installed).


@contextmanager
def absorbed_mla_duplicated_linear(duplicated_linear):
    if HAVE_TE:
        yield
        return
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    original = absorbed_mla.TELinear
    absorbed_mla.TELinear = duplicated_linear
    try:
        yield
    finally:
        absorbed_mla.TELinear = original


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


class _StreamThatWaitsForNothing:
    def wait_event(self, event):
        return None

    def wait_stream(self, stream):
        return None


class _CudaOnCpu(types.ModuleType):
    """`torch.cuda` as a module on a CUDA-less machine sees it: streams that wait for nothing."""

    def __init__(self, cuda_module):
        super().__init__("torch.cuda")
        self._cuda = cuda_module

    def __getattr__(self, name):
        return getattr(self._cuda, name)

    def current_stream(self, device=None):
        return _StreamThatWaitsForNothing()


class _TorchOnCpu(types.ModuleType):
    """`torch` whose tensor factories put `device="cuda"` tensors on the CPU; everything else is torch."""

    def __init__(self, torch_module):
        super().__init__("torch")
        self._torch = torch_module
        self.cuda = _CudaOnCpu(torch_module.cuda)

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def _on_cpu(self, factory, *args, device=None, **kwargs):
        if device == "cuda" or (isinstance(device, self._torch.device) and device.type == "cuda"):
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    def zeros(self, *args, **kwargs):
        return self._on_cpu(self._torch.zeros, *args, **kwargs)

    def ones(self, *args, **kwargs):
        return self._on_cpu(self._torch.ones, *args, **kwargs)

    def empty(self, *args, **kwargs):
        return self._on_cpu(self._torch.empty, *args, **kwargs)

    def tensor(self, *args, **kwargs):
        return self._on_cpu(self._torch.tensor, *args, **kwargs)


def _torch_on_cpu_in(*module_names: str) -> None:
    import torch

    if torch.cuda.is_available():
        return
    for name in module_names:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TorchOnCpu):
            module.torch = _TorchOnCpu(torch)


def _pipeline_schedules_without_cuda() -> None:
    _torch_on_cpu_in("megatron.core.pipeline_parallel.schedules")


# --- 9. megatron-core's DDP grad buffers, optimizers and grad norms use CUDA tensors and streams ----
# `_ParamAndGradBucketGroup.start_grad_sync` asks `torch.cuda.current_stream()` before every grad
# reduction; the optimizers (`FP32Optimizer`'s scale, the mixed-precision and distributed
# optimizers' buffers), `clip_grads` and `finalize_model_grads` make `device="cuda"` tensors, and so
# does `core/utils.py`'s l2-norm fallback for the missing apex kernels. On a machine with no CUDA
# device those modules see item 8's `torch`: "cuda" tensors land on the CPU and the current stream
# waits for nothing; other modules are untouched. With a GPU nothing changes.

OPTIMIZER_MODULES = ("megatron.core.distributed.param_and_grad_buffer", "megatron.core.distributed.finalize_model_grads",
                     "megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
                     "megatron.core.optimizer.clip_grads", "megatron.core.utils")


def _optimizer_without_cuda() -> None:
    _torch_on_cpu_in(*OPTIMIZER_MODULES)


# --- 10. megatron-core's optimizers tell fp32 from fp16 params by CUDA type names ------------------
# `clip_grad_by_total_norm_fp32` asserts `param.grad.type() == 'torch.cuda.FloatTensor'` at every
# step, and the mixed-precision and distributed optimizers sort params by `param.type()` against
# 'torch.cuda.FloatTensor' / 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor', raising for
# anything else. On a machine with no CUDA device, inside this block (the trainer wraps building
# the optimizer and each step in it) a CPU tensor's `type()` answers with the CUDA name of its
# dtype; outside it, and with a GPU, nothing changes.


@contextmanager
def cuda_type_names():
    import torch

    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type

    def type_(tensor, *args, **kwargs):
        name = original(tensor, *args, **kwargs)
        if args or kwargs or tensor.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def enable_cpu_support() -> None:
    """Items 4, 6, 7 and 8, each where it applies (see the module docstring); idempotent."""
    _current_device_on_cpu_machines()
    with megatron_bridge_without_te():
        _peft_te_flags()
    _pipeline_embedding_without_cuda()
    _pipeline_schedules_without_cuda()
    _optimizer_without_cuda()
