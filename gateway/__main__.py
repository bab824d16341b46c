"""`python -m gateway`, and the installed `swarm-gateway` command: app.py run as `python app.py` runs it, from
wherever it is installed. It is run, not imported: imported as the module `app`, it would build the Flask app in
gunicorn's master before gunicorn's flags and the local swarm's peers are in the environment, and gunicorn's worker
would then find that one, already imported, instead of building its own."""

import runpy


def main() -> None:
    runpy.run_module("app", run_name="__main__")


if __name__ == "__main__":
    main()
