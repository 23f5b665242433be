"""The top-p threshold key two ways, for the tests of the Triton top-p passes: the reference's (`radix_select`
over the fixed-point masses of the allowed tokens, as `modeling.sampler.reference.sample_torch` selects) and the
one the kernels leave for the sample pass (state and histograms of `triton_sampler.sample_triton(state=...)`)."""
import torch

from modeling.sampler import SamplerParams
from modeling.sampler import numerics as nx
from modeling.sampler.collectives import ShardGroup
from modeling.sampler.reference import radix_select


def reference_key(x: torch.Tensor, p: SamplerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Unprocessed logits `[B, V]` (one shard, the whole vocabulary) -> (top-p key, key_lo before it) int64 `[B]`."""
    b = x.shape[0]
    z = x.float() * p.inv_temperature[:b, None]
    m = z.amax(1)
    keys = nx.ordered_key(z)
    group = ShardGroup(None)
    key_lo = torch.full((b,), nx.KEY_NEG_INF + 1, dtype=torch.int64, device=x.device)
    on_k = p.top_k[:b] > 0
    key_k = radix_select(keys, None, p.top_k[:b].to(torch.int64), on_k, group)
    key_lo = torch.where(on_k, torch.maximum(key_lo, key_k), key_lo)
    on_m = p.log_min_p[:b] > float("-inf")
    key_lo = torch.where(on_m, torch.maximum(key_lo, nx.ordered_key(m + p.log_min_p[:b])), key_lo)
    q = nx.mass(z, m, keys >= key_lo.unsqueeze(1))
    total = q.sum(1)
    return radix_select(keys, q, nx.top_p_target(total, p.top_p_fixed[:b]), total > 0, group), key_lo


def kernel_key(state: dict) -> torch.Tensor:
    """The threshold the sample pass takes: the one found from candidates (state 5 slot 2) where there is one,
    else the radix's level-3 prefix and the bin of its remaining mass (`find_bin`)."""
    st, hist = state["st"], state["hist"]
    h = hist[5, :, :1024]
    suf = h.flip(1).cumsum(1).flip(1)
    d = ((suf >= st[4, :, 2:3]).sum(1) - 1).clamp(min=0)
    return torch.where(st[5, :, 2] > 0, st[5, :, 2], (st[4, :, 1] << 10) | d)


def resolved_rows(state: dict) -> list[bool]:
    """Per row: whether the candidates held the threshold (else the radix levels found it)."""
    return (state["st"][5, :, 2] > 0).tolist()
