from cfrun.agent.main import main

main()
