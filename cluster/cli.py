def main():
    raise SystemExit("dsa-serve: not yet")
