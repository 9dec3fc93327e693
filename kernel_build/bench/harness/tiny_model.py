"""A tiny model folder of DeepSeek-V3's architecture for the real-server GPU tests and the end-to-end benchmark.

`write_model(dir, layers=8, nextn=True)` writes what `sglang.launch_server --model-path DIR --load-format dummy`
needs and nothing more: a `config.json` of the DeepSeek-V3 / Kimi-K2 attention (MLA: kv_lora_rank 512 + rope 64,
so the KV cache holds one 576-wide latent head and v is its first 512 dims; 8 query heads, one TP-8 rank's share of
Kimi-K2's 64; yarn rope, so `layer.scaling` carries the mscale as in the real checkpoints), dense MLPs in every
target layer (small and fast: the attention is what the tests exercise), and, with nextn, one MTP layer (MoE, as
DeepSeek-V3's is) for `--speculative-algorithm NEXTN`; and a word-level tokenizer built offline with the
`tokenizers` package, so `/v1/completions` takes text. No weights: `--load-format dummy` fills them with random
values, so the model's outputs are deterministic noise (greedy decoding is still deterministic, which is what the
comparisons need).

`write_dflash_drafter(dir, target_layers, block_size)` writes a one-layer DFlash block drafter for that target
(SGLang's `DFlashDraftModel`, config only, for `--speculative-algorithm DFLASH --speculative-draft-load-format dummy`):
Qwen3-style MHA, 8 heads of 128, the target's hidden size and vocabulary (it borrows the target's embedding and LM
head), reading the target's hidden states after layers 1 and layers-2 (DeepSeek captures id+1 inside the next layer,
so an id must be at most layers-2).

The tokenizer splits on whitespace and knows VOCAB words `w0` ... plus four special tokens, so a prompt of N known
words is N tokens (plus BOS): `prompt_of(n, seed)` makes one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HEADS = 8
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 128
V_HEAD_DIM = 128
SPECIAL = ("<s>", "</s>", "<unk>", "<pad>")  # ids 0..3: bos, eos, unk, pad (DeepSeek-V3: bos 0, eos 1)
VOCAB = 8192 - len(SPECIAL)  # words; with the specials the vocabulary is 8192, config.json's vocab_size
MAX_POSITIONS = 65536  # 32k-token prompts plus what is decoded after them


def config(layers: int = 8, nextn: bool = True) -> dict:
    """config.json of a tiny DeepSeek-V3-architecture model with `layers` dense target layers."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "vocab_size": VOCAB + len(SPECIAL),
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 3,
        "tie_word_embeddings": False,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "hidden_act": "silu",
        "num_hidden_layers": layers,
        "first_k_dense_replace": layers,  # every target layer dense; the MTP layer (index `layers`) is MoE
        "moe_layer_freq": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "q_lora_rank": 768,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
        "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        # 12 routed experts: not a power of two, so SGLang routes with its own Triton router, not FlashInfer's fused
        # kernel (which the GPU machine cannot load); 4 groups of 3, 4 experts a token, as DeepSeek-V3's shape
        "n_routed_experts": 12,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1 if nextn else 0,
        "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": 10000,
        "rope_scaling": {  # DeepSeek-V3's yarn: the attention scale is qk_head_dim**-0.5 times mscale**2
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def words(n: int = VOCAB) -> list[str]:
    return [f"w{i}" for i in range(n)]


def write_tokenizer(path: Path, n_words: int = VOCAB, max_positions: int = MAX_POSITIONS) -> None:
    """tokenizer.json (a whitespace word-level tokenizer of n_words words and the specials, with a BOS template) and
    tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate((*SPECIAL, *words(n_words)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "model_max_length": max_positions,
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})
    )


def write_model(path: str | Path, layers: int = 8, nextn: bool = True) -> Path:
    """The model folder at `path` (created): config.json, generation_config.json and the tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config(layers, nextn), indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    write_tokenizer(path)
    return path


def dflash_drafter_config(target_layers: int = 8, block_size: int = 16) -> dict:
    """config.json of a one-layer DFlash drafter for the tiny target of `target_layers` layers."""
    target = config(target_layers)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "torch_dtype": "bfloat16",
        "vocab_size": target["vocab_size"],
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rope_theta": 10000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        # mask_token_id: the pad token (no "<|MASK|>" in this vocabulary); target layers: see the module docstring
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": 3,
            "target_layer_ids": [1, target_layers - 2],
        },
    }


def write_dflash_drafter(path: str | Path, target_layers: int = 8, block_size: int = 16) -> Path:
    """The drafter's folder at `path` (created): config.json only (its weights are dummy)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dflash_drafter_config(target_layers, block_size), indent=1))
    return path


def prompt_of(n_tokens: int, seed: int = 0) -> str:
    """A prompt of exactly n_tokens words the tokenizer knows (n_tokens + 1 tokens with BOS), fixed by seed."""
    rng = random.Random(seed)
    vocab = words()
    return " ".join(rng.choice(vocab) for _ in range(n_tokens))
