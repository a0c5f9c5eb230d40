"""The megatron-core CPU shim is narrow: device rewriting and the tensor-type names exist only inside
`scoped()`, so the trainer's forward and backward never run under a TorchFunctionMode."""
import pytest
import torch

from parallel import cpu_shim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim only acts on CPU-only machines")


def test_scoped_rewrites_cuda_factories_and_type_names_only_inside():
    with cpu_shim.scoped():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        assert torch._C._is_torch_function_mode_enabled()
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch.ones(1).type() == "torch.FloatTensor"
    assert torch.Tensor.type is cpu_shim._plain_type
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")


def test_install_gives_megatron_its_cuda_stand_ins():
    pytest.importorskip("megatron.core", reason="the stand-ins are for megatron-core")
    cpu_shim.install()
    assert torch.cuda.current_device() == torch.device("cpu")
    state = torch.cuda.get_rng_state()
    assert torch.equal(state, torch.get_rng_state())
    torch.cuda.synchronize()  # a no-op instead of an error
