"""A stand-in for llama.cpp's llama-server in the bench's tests: the same command line, /health and
/completion, answering deterministically from the request (no model).

FAKE_LLAMA_SERVER_MODE=fail: print an error line and exit 1 before listening, as a server that cannot
load its model does.  Every request's JSON body is appended to $FAKE_LLAMA_SERVER_LOG (one line each)."""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def main() -> None:
    args = sys.argv[1:]
    if os.environ.get("FAKE_LLAMA_SERVER_MODE") == "fail":
        print("llama_model_load: error loading model: tensor 'blk.0' has wrong shape", flush=True)
        sys.exit(1)
    pids = os.environ.get("FAKE_LLAMA_SERVER_PIDS")
    if pids:
        (Path(pids) / str(os.getpid())).touch()
    port = int(args[args.index("--port") + 1])
    drafting = "-md" in args or "--spec-type" in args
    log = os.environ.get("FAKE_LLAMA_SERVER_LOG")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200, {"status": "ok"}) if self.path == "/health" else self._send(404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if log:
                with open(log, "a") as f:
                    f.write(json.dumps({"args": args, "body": body}) + "\n")
            prompt = body["prompt"]
            n = body["n_predict"]
            eos = prompt[0] == 0  # a prompt starting with token 0 ends early, at the end of sequence
            tokens = [(prompt[-1] + i) % 50 for i in range(2 if eos else n)] + ([99] if eos else [])  # 99: its EOS
            timings = {"prompt_n": len(prompt), "prompt_ms": 1.0, "predicted_n": len(tokens), "predicted_ms": 2.0}
            if drafting and prompt[0] != 2:  # after a prompt that starts with 2 it drafted nothing
                timings.update(draft_n=10, draft_n_accepted=4)
            self._send(200, {"content": "x", "tokens": tokens, "stop_type": "eos" if eos else "limit", "timings": timings})

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
