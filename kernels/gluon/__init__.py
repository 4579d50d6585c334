"""The Hopper (sm_90) kernel families written in Gluon: TMA, mbarriers and wgmma. Gluon never runs
under the interpreter; on a CPU machine these modules import and compile for sm_90 only."""
