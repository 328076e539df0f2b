"""A stand-in serving engine for the launch tests: started as the "engine binary" (vllm serve / sglang's
launch_server), it checks its argv against $FAKE_ENGINE_EXPECT (a JSON list of arguments that must appear,
in order where they are a flag and its value), writes the argv it got to $FAKE_ENGINE_ARGV, exits 3 when a
check fails, else answers OpenAI-style on the --port it was given with a known pace ($FAKE_ENGINE_GAP_S per
token, 8 tokens; a JSON object {"substring": seconds, ...} paces by the first substring found in the argv).
llama-server's argv names the model with --alias, vLLM's and SGLang's with --served-model-name.

It can also fail as a real engine does: $FAKE_ENGINE_FAIL is a JSON object {"substring": how, ...} (the first
substring found in the argv decides), `how` one of `sigill` (kills itself with SIGILL at start), `sigill-at-
first-request` (answers /v1/models, then SIGILL at its first completion request: llama.cpp's AMX matmul),
`sigill-at-request-N` (the same at its Nth), `hang` (never listens), `stall` (answers /v1/models, never a
completion). Each start appends its argv as one
JSON line to $FAKE_ENGINE_STARTS, so a test counts the starts."""

import asyncio
import json
import os
import signal
import sys
import time

from infer_tune.endpoint.loopback import Behaviour, _Handler


class _Dying(_Handler):
    """Dies with SIGILL at its `at`th completion request (the first: as llama.cpp does in its first AMX matmul)."""

    at = 1
    posts = 0

    async def respond(self, method, path, body, writer, headers) -> None:
        self.posts += method == "POST"
        if self.posts >= self.at:
            print("fake engine: ggml_backend_amx_mul_mat: illegal instruction", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGILL)
        await super().respond(method, path, body, writer, headers)


def main(argv: list[str]) -> int:
    if os.environ.get("FAKE_ENGINE_ARGV"):
        with open(os.environ["FAKE_ENGINE_ARGV"], "w") as f:
            json.dump(argv, f)
    expected = json.loads(os.environ.get("FAKE_ENGINE_EXPECT", "[]"))
    for i, arg in enumerate(expected):
        if arg not in argv:
            print(f"fake engine: missing argument {arg!r} in {argv}", file=sys.stderr)
            return 3
        if arg.startswith("--") and i + 1 < len(expected) and not expected[i + 1].startswith("--"):
            at = argv.index(arg)
            if at + 1 >= len(argv) or argv[at + 1] != expected[i + 1]:
                print(f"fake engine: {arg} is not followed by {expected[i + 1]!r}", file=sys.stderr)
                return 3
    if argv == ["--version"]:  # what engines.llamacpp.build_info asks a llama-server with no build record
        print("version: 1 (0fa4e00)")
        return 0
    joined = " ".join(argv)
    if os.environ.get("FAKE_ENGINE_STARTS"):
        with open(os.environ["FAKE_ENGINE_STARTS"], "a") as f:
            f.write(json.dumps(argv) + "\n")
    fail = next((how for k, how in json.loads(os.environ.get("FAKE_ENGINE_FAIL", "{}")).items() if k in joined), None)
    if fail == "sigill":
        print("fake engine: illegal instruction at start", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGILL)
    if fail == "hang":
        print("fake engine: loading forever", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)  # the test's deadline stops it
    port = int(argv[argv.index("--port") + 1])
    name = argv[argv.index("--served-model-name" if "--served-model-name" in argv else "--alias") + 1]
    gap = json.loads(os.environ.get("FAKE_ENGINE_GAP_S", "0.005"))
    if isinstance(gap, dict):
        joined = " ".join(argv)
        gap = next((v for k, v in gap.items() if k in joined), gap.get("*", 0.005))
    dying = fail == "sigill-at-first-request" or (fail or "").startswith("sigill-at-request-")
    handler = (_Dying if dying else _Handler)(
        Behaviour(model=name, chunks=8, gap_s=float(gap), stall_s=3600.0 if fail == "stall" else 0.0))
    if fail and fail.startswith("sigill-at-request-"):
        handler.at = int(fail.rsplit("-", 1)[1])

    async def serve() -> None:
        server = await asyncio.start_server(handler.connection, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
