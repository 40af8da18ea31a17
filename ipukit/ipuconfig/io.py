"""An ``IPUConfig`` as text: dicts, JSON files, ``save_pretrained``/``from_pretrained``.

The serialisation half of optimum-graphcore's ``IPUConfig``, as a mixin of
:class:`~ipukit.IPUConfig`: writing (``to_dict``, ``to_json_string``,
``to_json_file``, ``save_pretrained``), reading (``from_dict``,
``from_json_file``, ``from_pretrained``, with the Hugging Face Hub when
``huggingface_hub`` is installed) and ``update_from_string``. Every value read
goes through the attribute rules of :mod:`ipukit.ipu_config_rules`.
"""
from __future__ import annotations

import copy
import json
import os
from typing import TYPE_CHECKING, Any, Dict, Union

from ..core.errors import UnsupportedError
from .rules import ATTRIBUTES, _SPEC, IPUConfigError, _parse_value, _unknown_keys_error

if TYPE_CHECKING:
    from .config import IPUConfig

IPU_CONFIG_NAME = "ipu_config.json"


class _IPUConfigFiles:
    """``IPUConfig``'s serialisation: to and from dicts, JSON, folders and the Hub."""

    def to_dict(self) -> Dict[str, Any]:
        """Every attribute (not the mode), as a JSON-serialisable dict."""
        return {name: copy.deepcopy(getattr(self, name)) for name in ATTRIBUTES}

    def to_json_string(self, use_diff: bool = True) -> str:
        """The configuration as JSON (sorted keys, 2-space indent, final newline).

        ``use_diff`` is accepted for optimum's signature; every attribute is written
        either way, as optimum's IPUConfig did.
        """
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: Union[str, os.PathLike], use_diff: bool = True) -> None:
        """Write :meth:`to_json_string` to ``json_file_path``."""
        with open(json_file_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string(use_diff))

    def save_pretrained(self, save_directory: Union[str, os.PathLike], **kwargs: Any) -> str:
        """Write ``save_directory/ipu_config.json`` (the folder is created); returns the path."""
        if kwargs.get("push_to_hub"):
            raise UnsupportedError(
                "IPUConfig.save_pretrained(push_to_hub=True): ipukit does not upload. Save "
                "locally, then upload ipu_config.json with huggingface_hub's upload_file.")
        if os.path.isfile(save_directory):
            raise IPUConfigError(
                f"IPUConfig.save_pretrained({str(save_directory)!r}): that is a file; pass a "
                f"directory (the file written is <directory>/{IPU_CONFIG_NAME}).")
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, IPU_CONFIG_NAME)
        self.to_json_file(path)
        return path

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any], **kwargs: Any):
        """Build from a dict (an ``ipu_config.json``'s contents); ``kwargs`` override attributes.

        With ``return_unused_kwargs=True`` returns ``(config, unused)`` and unknown
        override keys are returned instead of raising.
        """
        return_unused = kwargs.pop("return_unused_kwargs", False)
        if not isinstance(config_dict, dict):
            raise IPUConfigError(f"IPUConfig.from_dict({config_dict!r}): expected a dict.")
        config = cls(**config_dict)
        unused = {k: v for k, v in kwargs.items() if k not in _SPEC}
        if unused and not return_unused:
            raise _unknown_keys_error(unused, "override has")
        for key, value in kwargs.items():
            if key in _SPEC:
                setattr(config, key, value)
        if len(unused) < len(kwargs):
            config._validate_ipu_config()
        return (config, unused) if return_unused else config

    @classmethod
    def from_json_file(cls, json_file: Union[str, os.PathLike]) -> "IPUConfig":
        """Build from a JSON file."""
        return cls.from_dict(_read_json(str(json_file)))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike],
                        **kwargs: Any):
        """Load an ``ipu_config.json``: a file, a folder holding one, or a Hugging Face Hub id.

        Keyword arguments that name attributes override the loaded values (then the
        cross-checks run again); ``revision=``, ``cache_dir=``, ``token=`` go to the Hub
        download; ``return_unused_kwargs=True`` returns ``(config, unused)``. A Hub id
        (``"Graphcore/vit-base-ipu"``) needs ``huggingface_hub`` and a network connection;
        otherwise download the file and pass its path.
        """
        hub_kwargs = {k: kwargs.pop(k) for k in ("revision", "cache_dir", "token",
                                                  "use_auth_token", "force_download",
                                                  "local_files_only", "subfolder")
                      if k in kwargs}
        path = _resolve(str(pretrained_model_name_or_path), hub_kwargs)
        return cls.from_dict(_read_json(path), **kwargs)

    def update_from_string(self, update_str: str) -> "IPUConfig":
        """Update attributes from ``"name=value,name=value"``.

        Values are read as the attribute's type: ints, floats, ``true``/``false``
        (also ``1``/``0``, ``yes``/``no``), strings as they are, lists as
        ``[a b c]``; ``none`` sets an optional attribute to None. The cross-checks run
        after all the updates, e.g. ``"layers_per_ipu=[4 4],ipus_per_replica=2"``.
        """
        if not isinstance(update_str, str):
            raise IPUConfigError(f"IPUConfig.update_from_string({update_str!r}): expected a string "
                                 "such as 'device_iterations=4,layers_per_ipu=[2 2]'.")
        updates = {}
        for item in update_str.split(","):
            key, sep, text = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise IPUConfigError(
                    f"IPUConfig.update_from_string({update_str!r}): {item!r} is not name=value. "
                    "Separate updates with commas and list items with spaces: "
                    "'device_iterations=4,layers_per_ipu=[2 2]'.")
            if key not in _SPEC:
                raise _unknown_keys_error([key], "update_from_string:")
            updates[key] = _parse_value(key, text.strip(), getattr(self, key))
        for key, value in updates.items():
            setattr(self, key, value)
        self._validate_ipu_config()
        return self


def _read_json(path: str) -> Dict[str, Any]:
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


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return (1 <= len(parts) <= 2 and all(parts) and not name.endswith(".json")
            and not name.startswith((".", "~")))


def _resolve(name: str, hub_kwargs: Dict[str, Any]) -> str:
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
    local_hint = (f"Download {IPU_CONFIG_NAME} from https://huggingface.co/{name} and pass its "
                  "local path (or the folder holding it) to IPUConfig.from_pretrained.")
    if not _looks_like_hub_id(name):
        raise IPUConfigError(f"IPUConfig.from_pretrained({name!r}): no such file or folder. Pass "
                             f"the path of an {IPU_CONFIG_NAME}, a folder holding one, or a "
                             "Hugging Face Hub id such as 'Graphcore/vit-base-ipu'.")
    try:
        import huggingface_hub
    except ImportError:
        raise IPUConfigError(
            f"IPUConfig.from_pretrained({name!r}): no local file or folder of that name, and "
            "loading from the Hugging Face Hub needs the huggingface_hub package, which is not "
            f"installed (pip install huggingface_hub). {local_hint}") from None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise IPUConfigError(
            f"IPUConfig.from_pretrained({name!r}): no local file or folder of that name, and "
            f"HF_HUB_OFFLINE is set, so the Hub is not asked. {local_hint}")
    if "use_auth_token" in hub_kwargs:
        hub_kwargs["token"] = hub_kwargs.pop("use_auth_token")
    try:
        return huggingface_hub.hf_hub_download(name, IPU_CONFIG_NAME, **hub_kwargs)
    except Exception as exc:  # noqa: BLE001 - offline, missing repo or file: one clear message
        raise IPUConfigError(
            f"IPUConfig.from_pretrained({name!r}): could not fetch {IPU_CONFIG_NAME} from the "
            f"Hugging Face Hub ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            f"Check the id and the network, or: {local_hint}") from exc
