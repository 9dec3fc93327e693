"""One tensor-parallel rank of Kimi-K2.5 at TP 8, as a model one GPU runs at TP 1: the shapes of the deployment
(compose/kimi-ddtree.yaml) for measuring how a decode step's cost grows with the tokens it verifies.

What one rank of `sglang.launch_server --tp-size 8` holds of Kimi-K2.5 (DeepseekV3ForCausalLM: 61 layers, the first
dense, hidden 7168, MLA with 64 heads, 384 routed experts of 2048 and one shared, 8 a token, vocabulary 163,840),
read from SGLang 0.5.23's sharding:
- attention: the heads split (64 / 8 = 8 a rank; the MLA latent, q_lora 1536 and kv_lora 512 + rope 64, whole);
  o_proj is row-parallel: an all-reduce of hidden x tokens after it;
- experts: without --ep-size, SGLang's fused MoE splits every expert's intermediate over the ranks (2048 / 8 = 256 a
  rank, all 384 experts on every rank) and the shared expert's too; an all-reduce after the MoE; the dense layer's
  MLP likewise (18432 / 8 = 2304);
- the vocabulary: embedding and lm_head split by rows (163,840 / 8 = 20,480 a rank; the logits gathered after).
So a TP-1 model with 8 heads, experts of 256 and a vocabulary of 20,480 does one rank's GEMMs and attention; what it
leaves out are the two all-reduces a layer and the logits' gather, whose bytes `allreduce_bytes` counts (their time
over PCIe is a model, not a measurement: the benchmark says so).

The real checkpoint keeps the routed experts in int4 (compressed-tensors, W4A16) and the rest in bf16. SGLang runs
int4 MoE through compiled Marlin kernels, which the test GPU's image cannot load (standins/), so the experts here are
bf16 (SGLang's Triton fused MoE): 4x the int4 bytes. `expert_bytes` gives both, and a benchmark that derives the
deployment's step from this model scales the expert GEMMs' memory-bound time by the ratio, saying so. At bf16 one MoE
layer of a rank holds 384 x 3 x 7168 x 256 x 2 B = 4.2 GB, so an 80 GB card holds about 15 layers beside a KV cache:
`layers_that_fit` says how many, and the step's cost for 61 layers is derived from the per-layer cost, stated as
derived.

The DFlash drafter (z-lab/Kimi-K2.5-DFlash, from its public card: 6 layers, hidden 7168, 64 query and 8 KV heads,
GQA) at TP 8: 8 query heads and one KV head a rank, block 8 as compose/kimi-ddtree.yaml runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import tiny_model

TP = 8
HIDDEN = 7168
LAYERS = 61  # the checkpoint's: the first dense, 60 MoE
HEADS = 64
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE = 384, 8, 2048
DENSE_INTERMEDIATE = 18432
VOCAB = 163840
DRAFTER = {"layers": 6, "heads": 64, "kv_heads": 8, "head_dim": 128}
MAX_POSITIONS = 262144  # a 128k prompt and what follows it


def config(layers: int, tp: int = TP) -> dict:
    """config.json of one TP-`tp` rank's shapes as a TP-1 DeepseekV3ForCausalLM of `layers` layers (the first dense).
    Kimi-K2's routing: sigmoid scores with a correction bias, one group, 8 of 384 experts, scaled by 2.827; a yarn
    rope reaching 256k positions (factor 64 over 4096: the scale only moves the softmax's constant, not the cost)."""
    cfg = tiny_model.config(layers=layers, nextn=False)
    cfg.update({
        "vocab_size": VOCAB // tp, "hidden_size": HIDDEN, "intermediate_size": DENSE_INTERMEDIATE // tp,
        "first_k_dense_replace": 1, "num_attention_heads": HEADS // tp, "num_key_value_heads": HEADS // tp,
        "q_lora_rank": 1536, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
        "num_experts_per_tok": EXPERTS_PER_TOKEN, "moe_intermediate_size": EXPERT_INTERMEDIATE // tp, "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 2.827, "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": 50000,
        "rope_scaling": {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    })  # fmt: skip
    return cfg


def drafter_config(target_layers: int, block_size: int = 8, tp: int = TP) -> dict:
    """config.json of the Kimi-K2.5 DFlash drafter's rank (dummy weights): the public drafter's layers and widths, its
    heads split over `tp`, reading the target's hidden states after two of its layers (at most target_layers - 2)."""
    cfg = tiny_model.dflash_drafter_config(target_layers, block_size)
    cfg.update({
        "vocab_size": VOCAB // tp, "hidden_size": HIDDEN, "intermediate_size": DENSE_INTERMEDIATE // tp,
        "num_hidden_layers": DRAFTER["layers"], "num_attention_heads": DRAFTER["heads"] // tp,
        "num_key_value_heads": max(1, DRAFTER["kv_heads"] // tp), "head_dim": DRAFTER["head_dim"],
        "max_position_embeddings": MAX_POSITIONS,
    })  # fmt: skip
    cfg["dflash_config"]["target_layer_ids"] = sorted({1, max(1, target_layers - 2)})
    return cfg


def write_model(path: str | Path, layers: int, tp: int = TP) -> Path:
    """The rank's model folder (config.json, generation_config.json, a word-level tokenizer of its vocabulary)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config(layers, tp), indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    tiny_model.write_tokenizer(
        path, n_words=VOCAB // tp - len(tiny_model.SPECIAL), max_positions=MAX_POSITIONS
    )
    return path


def write_drafter(path: str | Path, target_layers: int, block_size: int = 8, tp: int = TP) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter_config(target_layers, block_size, tp), indent=1))
    return path


def expert_bytes(tp: int = TP, bits: int = 16) -> int:
    """One MoE layer's routed experts on one rank (gate, up and down projections), at `bits` a weight."""
    return EXPERTS * 3 * HIDDEN * (EXPERT_INTERMEDIATE // tp) * bits // 8


def layer_bytes(tp: int = TP, expert_bits: int = 16) -> int:
    """One MoE layer's weights on one rank: the routed experts at expert_bits, the rest (attention, shared expert,
    router) in bf16."""
    q_lora, kv, rope, nope, v = 1536, 512, 64, 128, 128
    heads = HEADS // tp
    attention = (HIDDEN * (q_lora + kv + rope) + q_lora * heads * (nope + rope) + kv * heads * (nope + v)
                 + heads * v * HIDDEN)  # fmt: skip
    shared = 3 * HIDDEN * (EXPERT_INTERMEDIATE // tp)
    router = HIDDEN * EXPERTS
    return expert_bytes(tp, expert_bits) + 2 * (attention + shared + router)


def kv_bytes_per_token(layers: int) -> int:
    """The MLA cache a token holds on every rank: one 576-wide latent a layer, bf16."""
    return layers * (512 + 64) * 2


def layers_that_fit(gpu_bytes: int, kv_tokens: int, tp: int = TP, reserve: int = 12 * 2**30) -> int:
    """The most MoE layers of a rank (bf16 experts) whose weights and a KV cache of kv_tokens fit in gpu_bytes,
    `reserve` kept for the embedding, lm_head, the drafter, activations, CUDA graphs and the context."""
    per_layer = layer_bytes(tp) + kv_bytes_per_token(1) * kv_tokens
    return max(0, (gpu_bytes - reserve) // per_layer)


def allreduce_bytes(tokens: int, tp: int = TP, layers: int = LAYERS) -> int:
    """What one rank sends and receives in a decode step's all-reduces of `tokens` bf16 rows of hidden (two a layer:
    after attention and after the MLP), as ring all-reduce moves them: 2 (tp - 1) / tp of the buffer each way."""
    buffer = tokens * HIDDEN * 2
    return 2 * layers * 2 * (tp - 1) * buffer // tp
