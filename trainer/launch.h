// trainer/launch.h — `tandem-train launch`: one command that starts the rollout servers and N trainer ranks on
// this machine, sets the launch contract, streams rank 0, and stops everything when one process fails or on
// Ctrl-C (no orphans: children also die with the launcher, via PR_SET_PDEATHSIG).
#ifndef TANDEM_TRAINER_LAUNCH_H
#define TANDEM_TRAINER_LAUNCH_H

// argv[0] is "launch". Returns the process exit code.
int launch_main(int argc, char **argv);

#endif
