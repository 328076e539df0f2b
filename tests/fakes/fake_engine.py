"""A stand-in serving engine for the launch tests: started as the "engine binary" (vllm serve / sglang's
launch_server), it checks its argv against $FAKE_ENGINE_EXPECT (a JSON list of arguments that must appear,
in order where they are a flag and its value), writes the argv it got to $FAKE_ENGINE_ARGV, exits 3 when a
check fails, else answers OpenAI-style on the --port it was given with a known pace ($FAKE_ENGINE_GAP_S per
token, 8 tokens; a JSON object {"substring": seconds, ...} paces by the first substring found in the argv).
llama-server's argv names the model with --alias, vLLM's and SGLang's with --served-model-name."""

import asyncio
import json
import os
import sys

from infer_tune.endpoint.loopback import Behaviour, _Handler


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
    port = int(argv[argv.index("--port") + 1])
    name = argv[argv.index("--served-model-name" if "--served-model-name" in argv else "--alias") + 1]
    gap = json.loads(os.environ.get("FAKE_ENGINE_GAP_S", "0.005"))
    if isinstance(gap, dict):
        joined = " ".join(argv)
        gap = next((v for k, v in gap.items() if k in joined), gap.get("*", 0.005))
    handler = _Handler(Behaviour(model=name, chunks=8, gap_s=float(gap)))

    async def serve() -> None:
        server = await asyncio.start_server(handler.connection, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
