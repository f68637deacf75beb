#!/usr/bin/env python3
"""A scripted OpenAI-compatible model provider on loopback, for recording the fixture
(tools/record-fixture.sh) from a real gateway without any network.

    python3 tools/mock-provider.py PORT

GET /v1/models lists one model, "echo". POST /v1/chat/completions answers (streamed as
text/event-stream chunks when "stream": true):
- while the conversation has no tool result yet and the request offers tools: some reasoning
  (`reasoning_content` deltas), then one tool call (`read` of notes.txt if offered, else the
  first tool, with {} arguments);
- otherwise: reasoning, then a fixed assistant text in a few deltas.
Each streamed chunk is sent after a short pause, so the gateway's events are spread out a little.
"""

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PAUSE = 0.05  # seconds between streamed chunks


def pick_tool(tools):
    names = [t.get("function", {}).get("name") for t in tools or []]
    names = [n for n in names if n]
    if "read" in names:
        return "read", {"path": "notes.txt"}
    return (names[0], {}) if names else (None, None)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("mock-provider: " + (fmt % args) + "\n")

    def send_json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.rstrip("/").endswith("/models"):
            self.send_json(200, {"object": "list", "data": [{"id": "echo", "object": "model", "owned_by": "mock"}]})
        else:
            self.send_json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        req = json.loads(self.rfile.read(length) or b"{}")
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self.send_json(404, {"error": {"message": "not found"}})
            return
        messages = req.get("messages") or []
        has_tool_result = any(m.get("role") == "tool" for m in messages)
        tool, args = (None, None) if has_tool_result else pick_tool(req.get("tools"))
        rid = "chatcmpl-%d" % int(time.time() * 1000)
        if tool:
            reasoning = ["Let me check ", "the session first."]
            deltas = [{"role": "assistant", "content": ""}] + [{"reasoning_content": r} for r in reasoning]
            deltas.append({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                           "function": {"name": tool, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(args)}}]})
            finish = "tool_calls"
            full = {"role": "assistant", "content": None, "reasoning_content": "".join(reasoning),
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": tool, "arguments": json.dumps(args)}}]}
        else:
            reasoning = ["The user said ", "something; ", "echo it."]
            answer = "Hello from the mock model. I read notes.txt for you."
            words = answer.split(" ")
            parts = [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]
            deltas = [{"role": "assistant", "content": ""}] + [{"reasoning_content": r} for r in reasoning]
            deltas += [{"content": p} for p in parts]
            finish = "stop"
            full = {"role": "assistant", "content": answer, "reasoning_content": "".join(reasoning)}
        usage = {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}
        if not req.get("stream"):
            self.send_json(200, {"id": rid, "object": "chat.completion", "created": int(time.time()),
                                 "model": "echo", "choices": [{"index": 0, "message": full, "finish_reason": finish}],
                                 "usage": usage})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()

        def chunk(delta, finish_reason=None, extra=None):
            body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": "echo",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
            if extra:
                body.update(extra)
            self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(PAUSE)

        for d in deltas:
            chunk(d)
        chunk({}, finish, {"usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 18790
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    sys.stderr.write("mock-provider: listening on http://127.0.0.1:%d/v1\n" % server.server_address[1])
    server.serve_forever()
