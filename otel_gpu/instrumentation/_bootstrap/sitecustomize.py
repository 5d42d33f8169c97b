"""Put on ``PYTHONPATH`` by ``otel-gpu run``: instruments ``OTEL_GPU_INSTRUMENT`` in every Python
process the command starts (its subprocesses and workers too), then runs the ``sitecustomize``
this one shadows, if there is one.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _instrument() -> None:
    # `otel-gpu run` puts this directory on PYTHONPATH only when there are targets and a level
    # (or OTEL_GPU_CONTROL=on: armed at level 0)
    try:
        import otel_gpu
        from otel_gpu import config
        from otel_gpu.instrumentation import targets

        # only the program `otel-gpu run` executed (same pid after execve) warns at exit about
        # targets never imported; the Python processes it starts stay quiet
        program = config.run_program_pid()
        targets.report_at_exit(program is None or program == str(os.getpid()))
        otel_gpu.instrument_from_settings(via="otel-gpu run")
    except Exception as exc:  # never stop the program: say why and run it uninstrumented
        sys.stderr.write(
            f"otel-gpu: OTEL_GPU_INSTRUMENT not applied: {type(exc).__name__}: {exc}\n"
        )


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_instrument()
_chain()
