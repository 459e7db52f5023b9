"""``/docs``: Swagger UI for ``/openapi.json``, from the installed package, with no network.

FastAPI's own page loads Swagger UI from a CDN, so a broker on a closed network, or a browser
without one, showed a blank page. The assets here are Swagger UI's release build as the
``fastapi-offline`` wheel ships it (pinned: the UI changes only with that pin), served under
``/docs/assets``. The validator badge, which sends the document's URL to an online validator,
is off.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Final

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

DOCS_URL: Final = "/docs"
ASSETS_URL: Final = "/docs/assets"


def swagger_assets() -> Path:
    """The directory of Swagger UI's files in the installed ``fastapi-offline`` package."""
    return Path(str(resources.files("fastapi_offline").joinpath("static")))


def install_docs(app: FastAPI) -> None:
    """Serve Swagger UI at :data:`DOCS_URL` (create ``app`` with ``docs_url=None``)."""
    app.mount(ASSETS_URL, StaticFiles(directory=swagger_assets()), name="docs-assets")

    async def docs(request: Request) -> HTMLResponse:
        """Swagger UI on this broker's document; every file it loads is this broker's."""
        root = str(request.scope.get("root_path", ""))
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title}: API",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},
        )

    app.add_api_route(DOCS_URL, docs, methods=["GET"], include_in_schema=False)
