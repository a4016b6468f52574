"""``python -m csa_compressor`` runs the self-check; ``python -m csa_compressor bench ...`` the benchmark."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:])
    from .selfcheck import main as selfcheck_main

    return selfcheck_main(argv)


if __name__ == "__main__":
    sys.exit(main())
