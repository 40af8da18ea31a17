"""``ipu_config.json`` on disk and on the Hugging Face Hub (paths, text and dicts only);
``huggingface_hub`` (the ``ipukit[hub]`` extra) is imported only to fetch a Hub id."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Union

from ..core.errors import UnsupportedError
from .rules import IPUConfigError

IPU_CONFIG_NAME = "ipu_config.json"
#: ``from_pretrained`` keywords that go to the Hub download, not to the configuration
HUB_KWARGS = ("revision", "cache_dir", "token", "use_auth_token", "force_download",
              "local_files_only", "subfolder")


def read_json(path: str) -> Dict[str, Any]:
    """The JSON object in ``path`` (an ``ipu_config.json``'s attribute: value pairs)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise IPUConfigError(f"IPUConfig: cannot read {path!r} ({exc.strerror or exc}).") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IPUConfigError(f"IPUConfig: {path!r} is not valid JSON ({exc}). An ipu_config.json "
                             "holds one JSON object of attribute: value pairs.") from exc
    if not isinstance(data, dict):
        raise IPUConfigError(f"IPUConfig: {path!r} holds {type(data).__name__}, not a JSON "
                             "object of attribute: value pairs.")
    return data


def write_text(path: Union[str, os.PathLike], text: str) -> None:
    """Write ``text`` to ``path`` (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def save_path(save_directory: Union[str, os.PathLike], push_to_hub: bool = False) -> str:
    """``save_directory/ipu_config.json``, the folder created; ``save_pretrained``'s checks."""
    if push_to_hub:
        raise UnsupportedError(
            "IPUConfig.save_pretrained(push_to_hub=True): ipukit does not upload. Save "
            "locally, then upload ipu_config.json with huggingface_hub's upload_file.")
    if os.path.isfile(save_directory):
        raise IPUConfigError(
            f"IPUConfig.save_pretrained({str(save_directory)!r}): that is a file; pass a "
            f"directory (the file written is <directory>/{IPU_CONFIG_NAME}).")
    os.makedirs(save_directory, exist_ok=True)
    return os.path.join(save_directory, IPU_CONFIG_NAME)


def pop_hub_kwargs(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Take the Hub download's keywords (:data:`HUB_KWARGS`) out of ``kwargs``."""
    return {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}


def resolve(name: str, hub_kwargs: Dict[str, Any]) -> str:
    """A local file, ``<folder>/ipu_config.json``, or the Hub's copy of a repository's file."""
    if os.path.isfile(name):
        return name
    if os.path.isdir(name):
        path = os.path.join(name, hub_kwargs.get("subfolder") or "", IPU_CONFIG_NAME)
        if not os.path.isfile(path):
            raise IPUConfigError(f"IPUConfig.from_pretrained({name!r}): the folder has no "
                                 f"{IPU_CONFIG_NAME}. Pass the JSON file's own path, or a folder "
                                 f"written by save_pretrained.")
        return path
    if not _looks_like_hub_id(name):
        raise IPUConfigError(f"IPUConfig.from_pretrained({name!r}): no such file or folder. Pass "
                             f"the path of an {IPU_CONFIG_NAME}, a folder holding one, or a "
                             "Hugging Face Hub id such as 'Graphcore/vit-base-ipu'.")
    return _hub_download(name, dict(hub_kwargs))


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return (1 <= len(parts) <= 2 and all(parts) and not name.endswith(".json")
            and not name.startswith((".", "~")))


def _hub_download(name: str, hub_kwargs: Dict[str, Any]) -> str:
    """Fetch ``name``'s ``ipu_config.json`` with ``huggingface_hub`` (imported here only)."""
    local_hint = (f"Download {IPU_CONFIG_NAME} from https://huggingface.co/{name} and pass its "
                  "local path (or the folder holding it) to IPUConfig.from_pretrained.")
    try:
        import huggingface_hub
    except ImportError:
        raise UnsupportedError(
            f"IPUConfig.from_pretrained({name!r}): no local file or folder of that name, and "
            "loading from the Hugging Face Hub needs the huggingface_hub package, which is not "
            f'installed (pip install "ipukit[hub]"). {local_hint}') from None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise IPUConfigError(
            f"IPUConfig.from_pretrained({name!r}): no local file or folder of that name, and "
            f"HF_HUB_OFFLINE is set, so the Hub is not asked. {local_hint}")
    if "use_auth_token" in hub_kwargs:
        hub_kwargs["token"] = hub_kwargs.pop("use_auth_token")
    try:
        return huggingface_hub.hf_hub_download(name, IPU_CONFIG_NAME, **hub_kwargs)
    except Exception as exc:  # noqa: BLE001 - offline, missing repo or file: one clear message
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise IPUConfigError(
            f"IPUConfig.from_pretrained({name!r}): could not fetch {IPU_CONFIG_NAME} from the "
            f"Hugging Face Hub ({type(exc).__name__}: {first_line}). "
            f"Check the id and the network, or: {local_hint}") from exc
