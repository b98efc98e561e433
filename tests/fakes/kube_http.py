"""tests/fakes/kube.py's API server over HTTP, on 127.0.0.1: the REST paths, query parameters
and JSON bodies of the calls the fleet controller makes (Kubernetes' core/v1), so that the
official client (efdl.fleet.kube.client.ClientApi) is tested through its whole stack: URL
building, selectors, serialization, a delete's preconditions, status codes, timeouts.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from kubernetes import client as k

from efdl.fleet.kube.api import KubeConflict, KubeError, KubeNotFound
from tests.fakes.kube import FakeKube, Response

_ACTIVE = "status.phase!=Succeeded,status.phase!=Failed"


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}  # fmt: skip


class KubeHttp:
    """Serve ``fake`` at :attr:`url` until :meth:`close`; ``delay_s`` slows every answer."""

    def __init__(self, fake: FakeKube) -> None:
        self.fake = fake
        self.delay_s = 0.0
        self.forbidden: set[str] = set()  # methods answered 403 (a service account without RBAC)
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, code: int, doc: Any) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self, method: str) -> None:
                outer.requests.append(f"{method} {self.path}")
                time.sleep(outer.delay_s)
                if method in outer.forbidden:
                    self._answer(403, _status(403, "Forbidden", f"cannot {method} {self.path}"))
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                try:
                    self._answer(200, outer.route(method, self.path, body))
                except KubeNotFound as exc:
                    self._answer(404, _status(404, "NotFound", str(exc)))
                except KubeConflict as exc:
                    self._answer(409, _status(409, "Conflict", str(exc)))
                except KubeError as exc:
                    self._answer(500, _status(500, "InternalError", str(exc)))
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def do_DELETE(self) -> None:
                self._serve("DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def route(self, method: str, path: str, body: Any) -> Any:
        api = k.ApiClient()
        url = urlparse(path)
        query = {key: v[0] for key, v in parse_qs(url.query).items()}
        labels = dict(
            pair.split("=", 1) for pair in query.get("labelSelector", "").split(",") if pair
        )
        active = query.get("fieldSelector") == _ACTIVE
        assert query.get("fieldSelector") in (None, _ACTIVE), query
        m = re.fullmatch(r"/api/v1/(?:namespaces/([^/]+)/)?(nodes|pods|podtemplates)(?:/([^/]+))?",
                         url.path)  # fmt: skip
        assert m, path
        ns, kind, name = m.groups()
        if method == "GET" and kind == "nodes" and not name:
            items = api.sanitize_for_serialization(self.fake.list_nodes())
            return {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": items}
        if method == "GET" and kind == "pods" and not name:
            found = self.fake.list_pods(ns, labels or None, active)
            items = api.sanitize_for_serialization(found)
            return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        if method == "GET" and kind == "podtemplates" and name:
            return api.sanitize_for_serialization(self.fake.read_pod_template(ns, name))
        if method == "POST" and kind == "pods" and ns:
            made = self.fake.create_pod(ns, api.deserialize(Response(body), "V1Pod"))
            return api.sanitize_for_serialization(made)
        if method == "DELETE" and kind == "pods" and ns and name:
            pre = (body or {}).get("preconditions") or {}
            self.fake.delete_pod(ns, name, pre.get("uid", ""), pre.get("resourceVersion", ""))
            return _status(200, "", "deleted") | {"status": "Success"}
        raise AssertionError(f"not a call the controller makes: {method} {path}")
