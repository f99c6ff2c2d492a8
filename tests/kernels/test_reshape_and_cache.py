"""reshape_and_cache against :func:`kernels.reshape_and_cache.write_kv`: exact equality (a copy).

Caches start as NaN everywhere, so a slot written that should not be, or one left unwritten, shows;
slots of -1 are skipped; key/value are strided views of a fused QKV tensor, as the model passes them.
"""

from __future__ import annotations

import pytest
import torch

from kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref, reshape_and_cache_triton


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "block_size", "dtype", "cache_dtype"),
    [
        (2, 64, 16, torch.float32, torch.float32),
        (1, 128, 32, torch.bfloat16, torch.bfloat16),
        (3, 128, 16, torch.float32, torch.bfloat16),  # write_kv converts to the cache's dtype
        (7, 64, 32, torch.bfloat16, torch.bfloat16),
    ],
)
def test_kernel_matches_reference(device, kv_heads, head_dim, block_size, dtype, cache_dtype):
    g = torch.Generator().manual_seed(kv_heads)
    num_tokens, num_blocks, heads = 23, 5, 2 * kv_heads
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    key, value = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[0, 5, 22]] = -1
    slots = slots.to(device)
    caches = []
    for fn in (reshape_and_cache_ref, reshape_and_cache_triton):
        kc = torch.full(
            (num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=cache_dtype, device=device
        )
        vc = kc.clone()
        fn(key, value, kc, vc, slots)
        caches.append((kc, vc))
    for ref, got in zip(caches[0], caches[1]):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    written = (~caches[1][0].isnan()).all(dim=(2, 3)).flatten()
    assert int(written.sum()) == num_tokens - 3  # exactly the slots that are not -1


def test_dispatcher_on_cpu_is_the_reference():
    key = torch.randn(4, 2, 16)
    kc = torch.zeros(2, 4, 2, 16)
    vc = torch.zeros(2, 4, 2, 16)
    reshape_and_cache(key, key + 1, kc, vc, torch.tensor([7, -1, 0, 2]))
    assert torch.equal(kc.view(-1, 2, 16)[7], key[0]) and torch.equal(vc.view(-1, 2, 16)[2], key[3] + 1)
