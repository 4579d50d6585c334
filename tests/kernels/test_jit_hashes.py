"""Every jit function's Triton cache key is the same whatever the process hashed before it.

Triton 3.6 adds a callee's constexpr globals to its caller's key only where the callee was hashed
first, so a kernel compiled ahead (``fusedserve precompile``, the compile workers) after other
kernels could land under another key than the same kernel in the server, and the server compiled
it again (seen on an H100: 15 fused-MLP layer kernels of digits). Two fresh processes hash every
jit function of the kernels package in opposite orders: for any caller and callee, one of them
hashes the callee first and the other the caller.
"""

import json
import os
import subprocess
import sys

HASH_ALL = """
import importlib, json, pkgutil, sys
from triton.runtime.jit import JITCallable
import fusedserve.kernels as package

functions = {}
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    module = importlib.import_module(info.name)
    for name, value in vars(module).items():
        if isinstance(value, JITCallable) and getattr(value, "__module__", None) == info.name:
            functions[f"{info.name}.{name}"] = value
names = sorted(functions)
if sys.argv[1] == "reversed":
    names.reverse()
print(json.dumps({name: functions[name].cache_key for name in names}))
"""


def _hashes(order: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", HASH_ALL, order], env=env, capture_output=True, text=True,
                            timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_cache_keys_do_not_depend_on_the_order_functions_are_hashed():
    forward, backward = _hashes("sorted"), _hashes("reversed")
    assert len(forward) > 20, sorted(forward)  # every family's kernels and helpers were found
    differ = sorted(name for name in forward if forward[name] != backward[name])
    assert not differ, f"cache keys that depend on hashing order: {differ}"
