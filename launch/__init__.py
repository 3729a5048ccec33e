if __name__ != "mpcore.launch":  # reached by the bare name; mpcore/_names.py says why
    from mpcore._names import bare_import

    bare_import(__name__, __path__)
