"""How the KV pool is sized (jaxmtp/worker/memory.py): from an accelerator's free memory after
the weights and activations, from a byte budget, capped at what max_num_seqs requests
of max_model_len need, and a ValueError naming what to change when one request cannot
fit. The accelerator branch runs here on a stand-in device that reports memory stats."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from conftest import STORIES
from jaxmtp.models.registry import load_config
from jaxmtp.worker.memory import GiB, activation_bytes, page_bytes, plan_kv_pool

CFG = load_config(STORIES)


@dataclasses.dataclass
class FakeGPU:
    stats: dict
    platform: str = "gpu"
    process_index: int = 0  # plan_kv_pool reads this process's first device

    def memory_stats(self):
        return self.stats


def plan(devices, **kwargs):
    args = dict(page_size=16, num_draft_modules=0, max_pages_per_seq=33, max_num_seqs=4, max_num_batched_tokens=64,
                num_speculative_tokens=0, num_pages=None, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None)
    return plan_kv_pool(CFG, **{**args, **kwargs}, devices=devices)


def test_page_bytes_count_every_layer_of_k_and_v():
    per_token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4  # float32
    assert page_bytes(CFG, 16, 0) == 16 * per_token
    assert page_bytes(CFG, 16, 1) == 16 * per_token * (CFG.num_layers + 1) // CFG.num_layers


def test_an_accelerators_pool_is_what_the_weights_and_activations_leave():
    per_page = page_bytes(CFG, 16, 0)
    active = activation_bytes(CFG, 64, 4, 0)
    weights = 3 * GiB
    limit = int((weights + active + 50 * per_page) / 0.9) + 1  # room for 50 pages at 0.9
    gpu = FakeGPU({"bytes_limit": limit, "bytes_in_use": weights})

    def expected(utilization, devices=1):
        return (int(utilization * limit) - weights - active) * devices // per_page

    assert plan([gpu]).num_pages == expected(0.9) == 50
    assert plan([gpu], gpu_memory_utilization=0.9001).num_pages == expected(0.9001) > 50
    assert plan([gpu, gpu]).num_pages == expected(0.9, 2) == 100  # kv heads split over the devices
    roomy = FakeGPU({"bytes_limit": 10 * GiB, "bytes_in_use": weights})
    assert plan([roomy]).num_pages == 4 * 33  # never more than max_num_seqs requests of max_model_len


def test_a_byte_budget_and_the_cpu_default():
    per_page = page_bytes(CFG, 16, 0)
    assert plan([jax.devices("cpu")[0]], max_num_seqs=10**6, kv_cache_memory_bytes=100 * per_page).num_pages == 100
    assert plan([jax.devices("cpu")[0]], max_num_seqs=10**6).num_pages == 2 * GiB // per_page
    assert plan([jax.devices("cpu")[0]], num_pages=7).num_pages == 7


def test_a_pool_that_cannot_hold_one_request_names_what_to_change():
    per_page = page_bytes(CFG, 16, 0)
    with pytest.raises(ValueError, match="room for 10 pages .* needs 33: lower max_model_len or raise kv_cache_memory_bytes"):
        plan([jax.devices("cpu")[0]], kv_cache_memory_bytes=10 * per_page)
    with pytest.raises(ValueError, match="lower max_model_len or raise gpu_memory_utilization"):
        plan([FakeGPU({"bytes_limit": GiB, "bytes_in_use": GiB})])


def test_under_tensor_parallelism_a_device_holds_its_share_of_a_page():
    """GQA's K and V pages split by kv head; MLA's latent pages (no head dim) and the
    hidden pages of several MTP modules whole on every device. So an MLA pool does not
    grow with the devices: each holds all of it."""
    from jaxmtp.models.config import MLAConfig

    mla = dataclasses.replace(CFG, mla=MLAConfig(None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                                 v_head_dim=128))
    assert page_bytes(mla, 16, 1) == 16 * (CFG.num_layers + 1) * (512 + 64) * 4
    assert page_bytes(mla, 16, 1, 4) == page_bytes(mla, 16, 1)
    assert page_bytes(CFG, 16, 0, 4) == page_bytes(CFG, 16, 0) // 4
    hidden = 16 * CFG.hidden_size * 4  # one module's hidden page, float32
    assert page_bytes(CFG, 16, 2, 4) == (page_bytes(CFG, 16, 2) - hidden) // 4 + hidden

    for cfg, more in ((mla, 1), (CFG, 2)):  # a budget of 40 pages on each device
        args = dict(page_size=16, num_draft_modules=1, max_pages_per_seq=33, max_num_seqs=1000, max_num_batched_tokens=64,
                    num_speculative_tokens=1, num_pages=None, gpu_memory_utilization=0.9,
                    kv_cache_memory_bytes=40 * page_bytes(cfg, 16, 1))
        one, two = (plan_kv_pool(cfg, **args, devices=[jax.devices("cpu")[0]] * n).num_pages for n in (1, 2))
        assert (one, two) == (40, 40 * more), cfg.mla
