"""Model and tokenizer loading (HF id, local folder, GGUF file, builtin://) and the tiny demo model.

    names     the model paths we understand besides HF ids and folders (no heavy imports)
    loading   tokenizer, HF config and causal LM loading (torch, transformers)
    tiny      the tiny demo model and its character tokenizer
    builtin   builtin:// models: built locally or converted from a GGUF file (gguf.py), cached

This package re-exports nothing: `verl_async` and config validation import `names`, and
everything they import must stay free of torch (a config error prints in half a second).
Import from the module that does the job, e.g. `from verl_async.models.loading import load_tokenizer`.
"""
