from cfrun.agent.server import main

main()
