"""GGUF files as input: the defensive reader (`reader`), llama.cpp's vocabulary (`vocab`), a file's
metadata as its family's config (`config`), the file as a checkpoint (`checkpoint`), the tokenizer
rebuilt from it (`tokenizer`), and llama.cpp in-process (`llama_open`, `llamacpp_reference`).
The GGUF export (`export/gguf_export.py`) writes what these read."""
