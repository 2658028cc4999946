"""The cluster admin API (``kvring admin``): ``create_app(AdminSettings(...))`` builds the FastAPI app."""

from .app import create_app
from .settings import AdminSettings

__all__ = ["AdminSettings", "create_app"]
