#!/usr/bin/env bash
# Stage, for the GPU machine (Python 3.12, x86_64), the wheels Megatron's servers import and its
# image lacks: tqdm, flask + flask-restful (static engine, MegatronServer) and quart, hypercorn,
# pyzmq, msgpack (dynamic engine coordinator, OpenAI-style server). Into .dw/serve/small (2.9 MB,
# ignored by git); carry it in any device call that runs `bash .dw/recv.sh` (after
# ../shared/device/stage.sh, which puts recv.sh there).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .dw/serve/small
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .dw/serve/small \
  tqdm flask flask-restful werkzeug itsdangerous blinker click jinja2 markupsafe aniso8601 pytz six \
  pyzmq msgpack quart hypercorn h11 h2 hpack hyperframe priority wsproto aiofiles
echo "staged .dw/serve/small ($(du -sh .dw/serve/small | cut -f1)): carry [\".dw/recv.sh\", \".dw/serve/small\", ...]"
