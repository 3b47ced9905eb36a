"""gcp-storage-emulator as GCS behaves where tensorstore and the lease depend on it: `python gcs_server.py PORT BUCKET`.

The emulator (PyPI) serves the JSON API but leaves out two things GCS does: a download carries the object's
generation in `x-goog-generation` (tensorstore's OCDBT reads the manifest's generation from it, and fails
with "Malformed StorageGeneration" without it), and an upload with `ifGenerationMatch` is refused with 412
when the object's generation differs (0: the object exists) -- the create-only write a lease relies on.
This wraps its handlers with exactly those; everything else is the emulator's own.
"""

from __future__ import annotations

import sys
from http import HTTPStatus
from typing import Any

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _generation(storage: Any, bucket: str, name: str) -> str:
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return "0"


def _with_generation(handler: Any) -> Any:
    def wrapped(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
        handler(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            response["x-goog-generation"] = _generation(storage, request.params["bucket_name"],
                                                        request.params["object_id"])
    return wrapped


def insert(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> None:
    wanted, name = request.query.get("ifGenerationMatch"), (request.query.get("name") or [None])[0]
    if wanted and name and _generation(storage, request.params["bucket_name"], name) != wanted[0]:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json({"error": {"code": 412, "message": "Precondition Failed"}})
        return
    objects.insert(request, response, storage, *args, **kwargs)


def main(port: int, bucket: str) -> None:
    for _, handlers in server.HANDLERS:
        for method, handler in handlers.items():
            handlers[method] = {objects.download: _with_generation(objects.download), objects.insert: insert,
                                objects.get: _with_generation(objects.get)}.get(handler, handler)
    gcs = server.create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    gcs.run()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
