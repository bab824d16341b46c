"""The suite writes only under temporary folders: never into the user's own cache, where `make run` would then
find the tests' stored sessions (tests/conftest.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from config import Settings, SwarmSettings


def _under_the_temporary_folder(path) -> bool:
    return Path(path).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())


def test_the_default_session_store_and_cache_are_temporary_folders_of_the_suite():
    settings = Settings.from_env()
    assert settings.gateway.session_store is not None and _under_the_temporary_folder(settings.gateway.session_store)
    assert _under_the_temporary_folder(SwarmSettings.from_env().cache_dir)


def test_the_converted_models_are_still_found():
    models = SwarmSettings.from_env().cache_dir / "models"
    assert models.is_dir() and not _under_the_temporary_folder(models)  # the user's, read through a link
