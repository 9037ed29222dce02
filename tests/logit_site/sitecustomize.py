"""Loaded by Python at start-up in processes started by tests that record verifier logits
(tests/logit_record.py puts this folder on PYTHONPATH and sets EDGESPEC_TEST_LOGITS_DIR).

Once `edgespec.runtime.llama` is imported, the recorder wraps TreeContext.decode_tree so a verifier
child writes the logits of every tree it verifies where the test process can read them. Processes
that never import it (relays, other tools) pay nothing but this file.
"""
import importlib.abc
import importlib.util
import os
import sys

_TARGET = "edgespec.runtime.llama"


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            sys.modules[name] = module
            tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            if tests_dir not in sys.path:
                sys.path.append(tests_dir)
            import logit_record
            logit_record.install(os.environ["EDGESPEC_TEST_LOGITS_DIR"])

        spec.loader.exec_module = exec_and_install
        return spec


if os.environ.get("EDGESPEC_TEST_LOGITS_DIR"):
    sys.meta_path.insert(0, _InstallAfterImport())
