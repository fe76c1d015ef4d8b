from cfrun.cli.app import main

main()
