"""The one build step pyproject.toml cannot declare: gunicorn.conf.py installed beside app.py, where app.py hands it
to gunicorn (`python app.py` and swarm-gateway alike). Its name is gunicorn's default, read from the current folder
by a plain `gunicorn app:app` in a checkout; with a dot in it, it is no module (py-modules cannot ship it), and it
lies in no package's folder (package data cannot)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

GUNICORN_CONF = "gunicorn.conf.py"


class BuildPy(build_py):
    def run(self):
        super().run()
        self.copy_file(GUNICORN_CONF, str(Path(self.build_lib) / GUNICORN_CONF))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / GUNICORN_CONF)]

    def get_source_files(self):  # what an sdist takes of the sources, so that a wheel built from it has the file
        return [*super().get_source_files(), GUNICORN_CONF]


setup(cmdclass={"build_py": BuildPy})
