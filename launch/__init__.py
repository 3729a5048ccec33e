if __name__ != "mpcore.launch":  # reached by the bare name; mpcore/_names.py says why
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "mpcore" / "_names.py"))["bare_import"](
        __name__, __path__)
