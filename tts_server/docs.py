"""`/docs` (Swagger UI) and `/redoc` that work offline: their scripts, style and icon are the files the
`fastapi-offline` package ships, served by this app under `/docs/assets/`, instead of FastAPI's default CDN links.
(Swagger UI 5 or later: the schema is OpenAPI 3.1, which Swagger UI 4 does not render.)

ReDoc's sidebar shows its maker's logo from their CDN whatever the options; the pages' Content-Security-Policy
allows images from this server only, so the browser never asks another host (the logo is left out)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_PATH = "/docs/assets"
ASSETS_PACKAGE = ("fastapi_offline", "static")
SWAGGER_JS = f"{ASSETS_PATH}/swagger-ui-bundle.js"
SWAGGER_CSS = f"{ASSETS_PATH}/swagger-ui.css"
REDOC_JS = f"{ASSETS_PATH}/redoc.standalone.js"
FAVICON = f"{ASSETS_PATH}/favicon.png"
DOCS_CSP = "img-src 'self' data:"


def install(app: FastAPI) -> None:
    """Serve the docs pages and their assets; the app must be built with `docs_url=None, redoc_url=None`."""
    app.mount(ASSETS_PATH, StaticFiles(packages=[ASSETS_PACKAGE]), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")  # behind a proxy that strips a prefix, as FastAPI's own page
        page = get_swagger_ui_html(
            openapi_url=root + str(app.openapi_url),
            title=f"{app.title} - Swagger UI",
            swagger_js_url=root + SWAGGER_JS,
            swagger_css_url=root + SWAGGER_CSS,
            swagger_favicon_url=root + FAVICON,
            swagger_ui_parameters=app.swagger_ui_parameters,
        )
        page.headers["Content-Security-Policy"] = DOCS_CSP
        return page

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_redoc_html(
            openapi_url=root + str(app.openapi_url),
            title=f"{app.title} - ReDoc",
            redoc_js_url=root + REDOC_JS,
            redoc_favicon_url=root + FAVICON,
            with_google_fonts=False,
        )
        page.headers["Content-Security-Policy"] = DOCS_CSP
        return page
