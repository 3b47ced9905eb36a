"""The open-weight presets at their published sizes: each equals what its official config.json converts to,
`jaxgpt summary` prints the published parameter count, and transformers' own classes (on the meta device) count
the same."""

from __future__ import annotations

import pytest

from jaxgpt.commands import summary
from jaxgpt.io.hf import hf_config_to_model_config
from jaxgpt.model.presets import PRESETS

# config.json of each (the keys that matter), as published on the Hugging Face Hub
OFFICIAL = {
 "llama-3.1-8b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
   "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
   "rope_theta": 500000.0, "hidden_act": "silu", "rope_scaling": {
       "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192, "rope_type": "llama3"},
   "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "head_dim": 128},
 "qwen3-8b": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
   "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
   "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
   "rope_scaling": None, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
   "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36},
 "smollm2-135m": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
   "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
   "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000, "rope_scaling": None,
   "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False},
 "gemma-3-1b": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144,
   "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
   "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
   "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None, "query_pre_attn_scalar": 256,
   "sliding_window": 512, "sliding_window_pattern": 6, "final_logit_softcapping": None,
   "attn_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
   "attention_bias": False},
 "mistral-7b-v0.1": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 32000,
   "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
   "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
   "sliding_window": 4096, "hidden_act": "silu", "tie_word_embeddings": False},
}

PUBLISHED = {"llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360, "smollm2-135m": 134_515_008,
             "gemma-3-1b": 999_885_952, "mistral-7b-v0.1": 7_241_732_096}
CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
           "mistral": "MistralForCausalLM"}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_summary_prints_the_published_count_of_the_official_config(name, capsys):
    assert PRESETS[name] == hf_config_to_model_config(OFFICIAL[name], where=name)
    assert summary.main(["summary", "--preset", name]) in (0, None)
    total = capsys.readouterr().out.strip().splitlines()[-1]
    assert total.split()[-1] == f"{PUBLISHED[name]:,}", total


@pytest.mark.torch
@pytest.mark.parametrize("name", list(PUBLISHED))
def test_transformers_counts_the_same(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**OFFICIAL[name])
    with torch.device("meta"):
        model = getattr(transformers, CLASSES[config.model_type])(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]  # a tied head is counted once
