"""Each workaround in glm5_bridge/compat.py exists because upstream hard-codes CUDA or TE in one
place. Each test here checks that the reason still holds, so it FAILS once upstream no longer needs
the workaround (then delete the item and its test). The workarounds themselves are exercised by
every CPU test that builds a model."""

import inspect
import subprocess
import sys

import pytest
import torch

from glm5_bridge import compat

pytestmark = pytest.mark.skipif(compat.HAVE_TE or torch.cuda.is_available(),
                                reason="the workarounds only apply without TE / without CUDA")


def test_1_megatron_bridge_still_needs_te_to_import():
    proc = subprocess.run([sys.executable, "-c", "import megatron.bridge"], capture_output=True, text=True)
    assert proc.returncode != 0 and "No module named 'transformer_engine'" in proc.stderr


def test_2_provider_still_starts_nccl_and_seeds_cuda():
    from megatron.bridge.models.model_provider import ModelProviderMixin

    assert 'init_process_group("nccl")' in inspect.getsource(ModelProviderMixin.provide_distributed_model)
    assert "model_parallel_cuda_manual_seed" in inspect.getsource(ModelProviderMixin.initialize_model_parallel)


def test_3_provider_still_builds_mtp_spec_with_te():
    from megatron.bridge.models import gpt_provider

    assert "use_transformer_engine=True" in inspect.getsource(gpt_provider.mtp_block_spec)


def test_4_megatron_core_still_places_buffers_with_cuda_current_device():
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe.router import TopKRouter

    assert "torch.cuda.current_device()" in inspect.getsource(TopKRouter.__init__)
    assert "torch.cuda.current_device()" in inspect.getsource(RotaryEmbedding.get_emb)
    assert "torch.cuda.synchronize()" in inspect.getsource(filesystem_async)


def test_5_absorbed_mla_still_accepts_only_te_linear_as_duplicated():
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

    assert "linear_q_down_proj in [TELinear]" in inspect.getsource(AbsorbedMLASelfAttention.__init__)


def test_why_we_have_our_own_spec_and_norm():
    """Not compat items, but the reasons for spec.py and layers.Norm: upstream's DSA block spec
    needs TE, and megatron's torch norm refuses sequence parallelism."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as upstream_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    assert 'transformer_impl == "transformer_engine"' in inspect.getsource(upstream_spec._get_backend_spec_provider)
    assert "not config.sequence_parallel" in inspect.getsource(WrappedTorchNorm.__new__)


def test_7_language_module_still_moves_the_pipeline_embedding_with_cuda():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer.__wrapped__
    assert "weight.data = weight.data.cuda()" in inspect.getsource(original)


def test_8_pipeline_schedules_still_count_tokens_on_cuda():
    from megatron.core.pipeline_parallel import schedules

    for schedule in (schedules.forward_backward_no_pipelining,
                     schedules.forward_backward_pipelining_without_interleaving,
                     schedules.forward_backward_pipelining_with_interleaving):
        assert 'torch.zeros([], dtype=torch.int, device="cuda")' in inspect.getsource(schedule), schedule.__name__
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.cat is torch.cat  # everything else is torch itself


def test_9_ddp_buffers_and_optimizers_still_use_cuda_tensors_and_streams():
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.optimizer import FP32Optimizer

    assert "torch.cuda.current_stream()" in inspect.getsource(_ParamAndGradBucketGroup.start_grad_sync)
    assert "device='cuda'" in inspect.getsource(FP32Optimizer.__init__)
    assert "device='cuda'" in inspect.getsource(clip_grads.get_grad_norm_fp32)
    for name in compat.OPTIMIZER_MODULES:
        module = __import__(name, fromlist=["torch"])
        assert module.torch.tensor([1.0], device="cuda").device.type == "cpu", name
        assert module.torch.cat is torch.cat


def test_10_optimizers_still_check_cuda_type_names():
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert "param.grad.type() == 'torch.cuda.FloatTensor'" in inspect.getsource(clip_grads.clip_grad_by_total_norm_fp32)
    assert "model_param.type() == 'torch.cuda.FloatTensor'" in inspect.getsource(DistributedOptimizer)
    t = torch.zeros(2)
    with compat.cuda_type_names():
        assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
    assert t.type() == "torch.FloatTensor"

