"""The one compiled part: the training thread's notes in C (see exporter/syncwatch/instrument/notes.py).

Optional: where no C compiler or Python headers are at hand, the build goes on without it and
syncwatch uses the same classes in pure Python (``syncwatch.instrument.notes.IMPLEMENTATION``).
Everything else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("syncwatch.instrument._cnotes",
                             ["exporter/syncwatch/instrument/_cnotes.c"],
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                                 "-Wno-missing-field-initializers",
                                                 "-Wno-cast-function-type"],
                             optional=True)])
