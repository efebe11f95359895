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
}
SHORT_NAMES: dict[str, str] = {name: m.repo for name, m in CATALOG.items()}
