"""python -m services.decode_worker: a generation worker (vLLM or mocker) joining the mesh."""

from services.common.discovery import DECODE_WORKER
from services.common.worker_runtime import main

if __name__ == "__main__":
    main(DECODE_WORKER, role="decode")
