"""A minimal OTLP/HTTP (protobuf) trace receiver for harness's Tier B tests.

Decodes each `POST /v1/traces` body with the official Python bindings
(`opentelemetry-proto`, an implementation independent of the Rust exporter) and appends one
JSON line per span (`MessageToDict`: lowerCamelCase field names; ids turned to hex) to
the output file. Writes `<output>.ready` (same path, suffix replaced) once it listens.

    python recv.py PORT OUTPUT.jsonl
"""

import base64
import http.server
import json
import pathlib
import sys

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        with open(OUT, "a", encoding="utf-8") as f:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        d = MessageToDict(span)
                        # Ids as the W3C and Jaeger write them: lowercase hex, not base64.
                        for k in ("traceId", "spanId", "parentSpanId"):
                            if k in d:
                                d[k] = base64.b64decode(d[k]).hex()
                        f.write(json.dumps(d) + "\n")
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port, OUT = int(sys.argv[1]), sys.argv[2]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    pathlib.Path(OUT).with_suffix(".ready").touch()
    server.serve_forever()
