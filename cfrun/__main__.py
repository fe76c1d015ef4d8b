from cfrun.entry import main

main()
