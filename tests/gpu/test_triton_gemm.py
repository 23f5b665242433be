"""The skinny decode GEMM equals F.linear (bf16 tolerance) and is capturable."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m", [1, 2, 7, 16])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (1024, 3072), (6144, 1024), (151936, 1024), (100, 300)])
def test_skinny_gemm_matches_linear(m, n, k):
    from modeling.ops.triton_gemm import linear

    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    torch.testing.assert_close(linear(x, w).float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)


def test_skinny_gemm_graph_replay():
    from modeling.ops.triton_gemm import linear

    x = torch.randn(4, 1024, device="cuda").bfloat16()
    w = torch.randn(2048, 1024, device="cuda").bfloat16()
    linear(x, w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)
