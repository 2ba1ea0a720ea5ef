"""`make compose-check` (`python -m ops.compose_check`, run from the repository root): build the CPU compose
stack and run it for real. __main__.py holds the phases; prepare.py what the build needs where registries
do not answer (base images, wheels, host ports); shell.py the output and commands; stack.py the running
stack as the check sees it."""
