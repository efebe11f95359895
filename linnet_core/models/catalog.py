"""Known checkpoints by short name: the one table the CLI, completions and docs read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KnownModel:
    repo: str  # Hugging Face repo id
    model_type: str  # as its config.json names it
    parameters: str


CATALOG: dict[str, KnownModel] = {
    "phi-3-mini-4k-instruct": KnownModel("microsoft/Phi-3-mini-4k-instruct", "phi3", "3.8B"),
    "qwen3-0.6b": KnownModel("Qwen/Qwen3-0.6B", "qwen3", "0.6B"),
    "qwen3-1.7b": KnownModel("Qwen/Qwen3-1.7B", "qwen3", "1.7B"),
    "qwen3-4b": KnownModel("Qwen/Qwen3-4B", "qwen3", "4.0B"),
    "qwen2.5-0.5b-instruct": KnownModel("Qwen/Qwen2.5-0.5B-Instruct", "qwen2", "0.5B"),
    "qwen2.5-1.5b-instruct": KnownModel("Qwen/Qwen2.5-1.5B-Instruct", "qwen2", "1.5B"),
    "mistral-7b-instruct-v0.3": KnownModel("mistralai/Mistral-7B-Instruct-v0.3", "mistral", "7.2B"),
    "llama-3.2-1b-instruct": KnownModel("meta-llama/Llama-3.2-1B-Instruct", "llama", "1.2B"),
    "llama-3.1-8b-instruct": KnownModel("meta-llama/Llama-3.1-8B-Instruct", "llama", "8.0B"),
    "tinyllama-1.1b-chat": KnownModel("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "llama", "1.1B"),
    "gemma-2-2b-it": KnownModel("google/gemma-2-2b-it", "gemma2", "2.6B"),
    "gemma-3-1b-it": KnownModel("google/gemma-3-1b-it", "gemma3_text", "1.0B"),
    "smollm3-3b": KnownModel("HuggingFaceTB/SmolLM3-3B", "smollm3", "3.1B"),
    "granite-3.3-2b-instruct": KnownModel("ibm-granite/granite-3.3-2b-instruct", "granite", "2.5B"),
    "granite-3.3-8b-instruct": KnownModel("ibm-granite/granite-3.3-8b-instruct", "granite", "8.2B"),
    "olmo-2-1b-instruct": KnownModel("allenai/OLMo-2-0425-1B-Instruct", "olmo2", "1.5B"),
    "olmo-2-7b-instruct": KnownModel("allenai/OLMo-2-1124-7B-Instruct", "olmo2", "7.3B"),
    "qwen3-30b-a3b": KnownModel("Qwen/Qwen3-30B-A3B", "qwen3_moe", "30.5B (3.3B active)"),
    "mixtral-8x7b-instruct": KnownModel("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral", "46.7B (12.9B active)"),
}
SHORT_NAMES: dict[str, str] = {name: m.repo for name, m in CATALOG.items()}
