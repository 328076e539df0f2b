from infer_tune.cli import main

main()
