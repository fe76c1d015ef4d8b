from cfrun.cli import main

main()
