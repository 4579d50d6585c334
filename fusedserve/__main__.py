"""``python -m fusedserve serve [flags]``: the same as the ``fusedserve`` command."""

from fusedserve.service.cli import main

main()
