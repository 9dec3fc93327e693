"""SGLang's own TritonAttnBackend and MLATokenToKVPool at production shapes, for the GPU tests and
kernel_build/bench/benchmarks/bench_modes.py.

Built with SGLang's attention test kit (MockMLAModelRunner via build_mla_attention_fixture): kv_lora_rank 512 +
rope 64, bf16, one KV head, random topologically ordered draft trees (EAGLE FULL-mask layout), shuffled prefix
slots, k and v passed, save_kv_cache=True. With `layers` > 1 the pool holds that many layers (each its own KV,
random), as one verify step of a model calls every layer's attention with the same metadata. With `kv_dtype` (fp8)
the pool is SGLang's MLATokenToKVPool of that dtype (as --kv-cache-dtype fp8_e4m3 / fp8_e5m2 makes it) and
`kv_scales` the checkpoint's k_scale / v_scale, loaded into each layer by SGLang's own BaseKVCacheMethod.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

SCALE = (
    192**-0.5
)  # DeepSeek-V3's softmax scale: qk_nope + qk_rope = 192, not 576 (times yarn's mscale**2 in a model)

# What SGLang 0.5.23's TritonAttnBackend hands forward_extend for target-verify, as kdtree.verify.describe_call
# records it (dtypes of the metadata and of q/k/v, and the pool's row layout): the contract kdtree.kernel checks.
# This fixture builds calls that match (test_hook_gpu), and the real server's rank records must show the same
# (test_engine_gpu): a test fails when SGLang changes it.
EXPECTED_EAGER = {
    "qo_indptr": "int32",  # built fresh per step
    "kv_indptr": "int32",
    "kv_indices": "int64",
    "mask_indptr": "int64",
    "custom_mask": "bool",  # FULL layout, fresh per step
    "q": "bfloat16",
    "k": "bfloat16",
    "v": "bfloat16",
}
EXPECTED_CAPTURED = {
    **EXPECTED_EAGER,
    "qo_indptr": "int64",
    "custom_mask": "uint8",
}  # the graph's static buffers
EXPECTED_POOL = [
    "bfloat16",
    [1, 576],
    576,
]  # MLATokenToKVPool: one latent head a slot, v = its first 512 dims


@dataclass
class Setup:
    backend: object
    runner: object
    fb: object
    layers: list  # RadixAttention per pool layer, layer_id = index
    q: object
    k: object
    v: object
    prefix_lens: tuple
    n: int
    ancestors: list

    @property
    def layer(self):
        return self.layers[0]

    @property
    def kv(self):
        return self.runner.token_to_kv_pool.get_key_buffer(0)


def expected_scaling(model_dir) -> float:
    """The softmax scale of a DeepSeek-V3 checkpoint's attention: qk_head_dim**-0.5 times mscale**2 with yarn rope,
    mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (DeepSeek-V3's modelling code), from its config.json."""
    import json
    import math
    from pathlib import Path

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = cfg.get("rope_scaling") or {}
    if rope.get("factor", 1) > 1 and rope.get("mscale_all_dim"):
        scale *= (0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1) ** 2
    return scale


def described_dtypes(description: dict) -> dict:
    """The dtypes of a describe_call description, in EXPECTED_EAGER's form."""
    return {k: (description[k] or [None])[0] for k in EXPECTED_EAGER}


def random_trees(count, n, gen):
    """Draft masks [n, n] of `count` random trees whose parents precede their children."""
    from kdtree.reference import random_parents, tree_mask_rows

    return [tree_mask_rows(random_parents(n, gen)) for _ in range(count)]


def full_mask(prefix_lens, ancestors):
    from kdtree.reference import full_layout_mask

    return full_layout_mask(prefix_lens, ancestors).cuda()


def build(torch, heads, prefix_lens, n, *, graphs=False, seed=0, max_context_len=256, layers=1, kv_dtype=None,
          kv_scales=None) -> Setup:  # fmt: skip
    import pytest
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
        MLAAttentionCase,
        build_mla_attention_fixture,
    )
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        _prepare_target_verify_batch,
    )

    bs = len(prefix_lens)
    case = MLAAttentionCase(name=f"kdtree_h{heads}_n{n}", backend="triton", forward_mode=ForwardMode.TARGET_VERIFY,
                            num_heads=heads, page_size=1, prefix_lens=tuple(prefix_lens), extend_lens=(n,) * bs)  # fmt: skip
    kit = SimpleNamespace(skipTest=pytest.skip)
    fx = build_mla_attention_fixture(kit, case, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                                     max_context_len=max_context_len, disable_cuda_graph=not graphs,
                                     runner_batch_size=bs, loc_layout="shuffled_pages")  # fmt: skip
    if layers > 1 or kv_dtype is not None:  # a pool of `layers` (the kit's has one) or of kv_dtype, random KV
        one = fx.runner.token_to_kv_pool
        pool = MLATokenToKVPool(size=one.size, page_size=1, dtype=kv_dtype or torch.bfloat16, kv_lora_rank=512,
                                qk_rope_head_dim=64, layer_num=layers, device="cuda", enable_memory_saver=False)  # fmt: skip
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for i in range(layers):
            buf = pool.get_key_buffer(i)
            buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda", dtype=torch.float32).to(buf.dtype))
        fx.runner.token_to_kv_pool = fx.backend.token_to_kv_pool = pool
    fb = fx.forward_batch
    _prepare_target_verify_batch(fb, case, "cuda")  # seq_lens = committed prefix, as production
    gen = torch.Generator().manual_seed(seed)
    ancestors = random_trees(len(prefix_lens), n, gen)
    t = bs * n
    fb.spec_info = EagleVerifyInput(
        draft_token=fb.input_ids, custom_mask=full_mask(prefix_lens, ancestors), positions=fb.positions,
        retrieve_index=torch.arange(t, device="cuda").view(bs, n),
        retrieve_next_token=torch.full((bs, n), -1, device="cuda"),
        retrieve_next_sibling=torch.full((bs, n), -1, device="cuda"),
        retrieve_cum_len=torch.arange(bs + 1, dtype=torch.int32, device="cuda") * n,
        spec_steps=n - 1, topk=2, draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=fb.seq_lens_sum, seq_lens_cpu=fb.seq_lens_cpu,
    )  # fmt: skip
    attn = [
        RadixAttention(heads, 576, scaling=SCALE, num_kv_heads=1, layer_id=i, v_head_dim=512)
        for i in range(layers)
    ]
    if kv_scales is not None:
        from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod

        method = BaseKVCacheMethod(quant_config=None)
        for layer in attn:
            method.create_weights(layer)
            layer.k_scale.data.fill_(kv_scales[0])
            layer.v_scale.data.fill_(kv_scales[1])
            method.process_weights_after_loading(layer)
            layer.k_scale.data, layer.v_scale.data = layer.k_scale.data.cuda(), layer.v_scale.data.cuda()
    k = torch.randn(t, 1, 576, dtype=torch.bfloat16, device="cuda")
    s = Setup(fx.backend, fx.runner, fb, attn, torch.randn(t, heads, 576, dtype=torch.bfloat16, device="cuda"),
              k, k[..., :512].clone(), tuple(prefix_lens), n, ancestors)  # fmt: skip
    return s


def forward(s, layer: int = 0):
    """The production call chain: RadixAttention.forward -> backend.forward -> forward_extend (k, v, save)."""
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=s.backend)):
        return s.layers[layer](s.q, s.k, s.v, s.fb, save_kv_cache=True)


def eager(s):
    s.backend.init_forward_metadata(s.fb)
    return forward(s)


def reference(torch, s):
    """fp32 PyTorch attention over the pool's prefix rows and the passed draft rows, with the tree mask; an fp8
    pool's rows dequantised with the layer's scales (keys by k_scale, values by v_scale)."""
    from kdtree.verify import kv_descales

    k_scale, v_scale = kv_descales(s.layer)
    req_to_token = s.runner.req_to_token_pool.req_to_token
    outs = []
    for b, (p, anc) in enumerate(zip(s.prefix_lens, s.ancestors, strict=True)):
        rows = slice(b * s.n, (b + 1) * s.n)
        prefix = s.kv[req_to_token[b, :p].long(), 0].float()
        keys = torch.cat([prefix * k_scale, s.k[rows, 0].float()])
        values = torch.cat([prefix[:, :512] * v_scale, s.v[rows, 0].float()])
        scores = torch.einsum("ihd,nd->hin", s.q[rows].float(), keys) * SCALE
        allow = torch.ones(s.n, p + s.n, dtype=torch.bool, device="cuda")
        allow[:, p:] = anc.cuda()
        probs = torch.softmax(scores.masked_fill(~allow, float("-inf")), dim=-1)
        outs.append(torch.einsum("hin,nd->ihd", probs, values))
    return torch.cat(outs).to(torch.bfloat16).view(-1, s.q.shape[1] * 512)


def capture(torch, s, call):
    """Warm up eagerly (as SGLang does before capture), then capture `call` into a real CUDA graph."""
    from kdtree.bench import capture_graph

    graph, out, _ = capture_graph(call)
    return graph, out


def graph_setup(torch, heads, prefix_lens, n, **build_args):
    from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
        _init_cuda_graph_capture_metadata,
    )

    s = build(torch, heads, prefix_lens, n, graphs=True, **build_args)
    _init_cuda_graph_capture_metadata(
        s.backend, len(prefix_lens), s.fb
    )  # static buffers, as the graph runner
    return s


def change_inputs_in_place(torch, s, step):
    """New q/k/v, new trees and new prefix KV, written into the captured tensors; then replay metadata."""
    from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
        _init_cuda_graph_replay_metadata,
    )

    gen = torch.Generator().manual_seed(100 + step)
    s.q.copy_(torch.randn(s.q.shape, generator=gen).to(s.q))
    s.k.copy_(torch.randn(s.k.shape, generator=gen).to(s.k))
    s.v.copy_(s.k[..., :512])
    s.ancestors = random_trees(len(s.prefix_lens), s.n, gen)
    s.fb.spec_info.custom_mask = full_mask(s.prefix_lens, s.ancestors)
    req_to_token = s.runner.req_to_token_pool.req_to_token
    for b, p in enumerate(s.prefix_lens):
        slots = req_to_token[b, :p].long()
        s.kv[slots] = torch.randn(p, 1, 576, generator=gen).to(s.kv)
    _init_cuda_graph_replay_metadata(s.backend, len(s.prefix_lens), s.fb)
