from infer_tune.cli import main

if __name__ == "__main__":  # spawned processes (load-generator workers, ranks) re-import this module
    main()
