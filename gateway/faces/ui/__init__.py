"""The inspector page, ``/ui``: the delivery log and the runs, in a browser, behind the
admin API's token. Server-rendered HTML, no JavaScript; see gateway/faces/ui/routes.py."""

from gateway.faces.ui.routes import ui_routes

__all__ = ["ui_routes"]
