"""The CLI's verbs beside fit/validate/test/predict, one module each with ``main(argv)``; listed in
``cli.dispatch.COMMANDS``."""
