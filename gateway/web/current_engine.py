"""The app's one Engine: create_app installs it on the Flask app, and every route reads it back with get_engine().

Flask's pattern for a per-app resource (its tutorial's get_db()): a module of its own, so that the API modules
share the accessor without importing one another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flask import current_app

if TYPE_CHECKING:  # docs.py reads the settings through here: no torch or swarm at its import
    from gateway.engine.generation import Engine


def install(app, engine: Engine) -> None:
    app.extensions["engine"] = engine


def get_engine() -> Engine:
    """The Engine of the app serving the current request."""
    return current_app.extensions["engine"]
