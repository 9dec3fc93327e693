"""The rank-shaped Kimi-K2.5 model (kernel_build/bench/harness/rank_model.py) as SGLang 0.5.23 reads it, and its byte
counts: what the cost-curve benchmark on one GPU rests on."""

from __future__ import annotations

import math

import pytest
import rank_model


def test_a_ranks_shapes_are_kimi_k25s_split_over_eight():
    cfg = rank_model.config(layers=4)
    assert (cfg["num_attention_heads"], cfg["moe_intermediate_size"], cfg["vocab_size"]) == (8, 256, 20480)
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["first_k_dense_replace"]) == (384, 8, 1)
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["q_lora_rank"], cfg["hidden_size"]) == (
        512,
        64,
        1536,
        7168,
    )
    assert rank_model.config(layers=4, tp=4)["num_attention_heads"] == 16  # 64 heads over 4
    d = rank_model.drafter_config(target_layers=4)
    assert (d["num_hidden_layers"], d["num_attention_heads"], d["num_key_value_heads"]) == (6, 8, 1)
    assert d["dflash_config"]["block_size"] == 8 and max(d["dflash_config"]["target_layer_ids"]) <= 4 - 2


def test_byte_counts():
    # 384 experts x (gate, up, down) x 7168 x 256 a rank: bf16 here, int4 in the checkpoint
    assert rank_model.expert_bytes() == 384 * 3 * 7168 * 256 * 2 == 4 * rank_model.expert_bytes(bits=4)
    assert 0 < rank_model.layer_bytes() - rank_model.expert_bytes() < 0.05 * rank_model.expert_bytes()
    assert rank_model.kv_bytes_per_token(61) == 61 * 576 * 2
    fit = rank_model.layers_that_fit(80 * 2**30, kv_tokens=140_000)
    assert 10 <= fit <= 16 and rank_model.layers_that_fit(141 * 10**9, kv_tokens=140_000) > fit
    # a ring all-reduce moves 2 (tp - 1) / tp of the buffer; two a layer
    assert rank_model.allreduce_bytes(33) == 2 * 61 * 2 * 7 * (33 * 7168 * 2) // 8
    assert math.isclose(rank_model.allreduce_bytes(33) / rank_model.allreduce_bytes(1), 33)


@pytest.mark.sglang
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_sglang_reads_the_rank_as_deepseek_v3_mla_with_its_yarn_scale(tmp_path):
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang_fixture import expected_scaling

    path = rank_model.write_model(tmp_path / "rank", layers=3)
    cfg = ModelConfig(str(path))
    assert (
        cfg.hf_config.architectures == ["DeepseekV3ForCausalLM"] and cfg.attention_arch == AttentionArch.MLA
    )
    assert (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.vocab_size) == (
        8,
        512,
        64,
        20480,
    )
    assert cfg.hf_config.n_routed_experts == 384 and cfg.hf_config.moe_intermediate_size == 256
    assert cfg.context_len == rank_model.MAX_POSITIONS
    assert math.isclose(cfg.scaling, expected_scaling(path), rel_tol=1e-12)
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == 20480 and tok("w20475")["input_ids"] == [0, 20479]
